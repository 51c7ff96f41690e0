"""DevicePlugin's API contract in-process: errors at construction/start, and serve() leaving nothing behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from deviceplane.plugin import Device, DevicePlugin, PluginError
from deviceplane.plugin.sim import Fault
from tests.support.plugins import short_tmpdir, wait_until


def test_invalid_resource_is_value_error():
    with pytest.raises(ValueError, match="invalid resource name 'gpu'"):
        DevicePlugin("gpu")


def test_env_defaults(monkeypatch):
    monkeypatch.setenv("DEVICEPLANE_PLUGIN_DIR", "/tmp/x-plugins")
    plugin = DevicePlugin("example.com/a")
    assert plugin.plugin_dir == Path("/tmp/x-plugins") and plugin.registry_dir is None
    assert plugin.socket_path.parent == Path("/tmp/x-plugins")
    monkeypatch.setenv("DEVICEPLANE_REGISTRY_DIR", "/tmp/x-registry")
    assert DevicePlugin("example.com/a").socket_path.parent == Path("/tmp/x-registry")


def test_two_plugins_in_one_process_get_distinct_sockets():
    assert DevicePlugin("example.com/a").socket_path != DevicePlugin("example.com/a").socket_path


async def test_run_inside_a_loop_is_refused():
    with pytest.raises(RuntimeError, match=r"await plugin\.serve"):
        DevicePlugin("example.com/a").run()


async def test_long_socket_path_is_a_plugin_error():
    plugin = DevicePlugin("example.com/a", plugin_dir="/tmp/" + "d" * 120)
    with pytest.raises(PluginError, match="longer than"):
        await plugin.serve()


async def test_serve_cancel_and_stop_leave_nothing():
    with short_tmpdir() as directory:
        fds_before = len(os.listdir("/proc/self/fd"))
        tasks_before = asyncio.all_tasks()
        plugin = DevicePlugin("example.com/a", [Device("x")], plugin_dir=directory)
        serving = asyncio.create_task(plugin.serve(handle_signals=False))
        await wait_until(plugin.socket_path.exists, within=5, what="plugin serving")
        with pytest.raises(RuntimeError, match="already serving"):
            await plugin.serve()
        plugin.stop()
        await asyncio.wait_for(serving, 5)
        assert not plugin.socket_path.exists()

        # Cancellation (e.g. Ctrl-C under asyncio.run) cleans up too, and the plugin can serve again.
        serving = asyncio.create_task(plugin.serve(handle_signals=False))
        await wait_until(plugin.socket_path.exists, within=5, what="plugin serving")
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert not plugin.socket_path.exists()
        await asyncio.sleep(0.1)
        assert asyncio.all_tasks() - tasks_before == set()
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 2  # gRPC keeps a few process-wide fds


def test_fault_parsing():
    assert Fault.from_json({"mode": "hang", "seconds": 1, "times": 2}).to_json() == {
        "mode": "hang",
        "message": "injected failure",
        "seconds": 1,
        "times": 2,
    }
    for bad in ({"mode": "boom"}, {"mode": "fail", "times": 0}, {"mode": "hang", "seconds": -1}, []):
        with pytest.raises(ValueError):
            Fault.from_json(bad)
