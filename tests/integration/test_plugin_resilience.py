"""An SDK plugin keeps serving through what its environment does to it: odd file names next to its socket, a crash
of one of its tasks, a chmod of its socket, another plugin taking its socket's name - and its RPCs refuse bad input
as a whole. In-process DevicePlugins on real unix sockets, with the kubelet stand-in."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.plugin import Allocation, Device, DevicePlugin, supervise
from deviceplane.plugin import plugin as plugin_module
from tests.support.plugins import Connection, FakeKubelet, short_tmpdir, wait_until

R = "example.com/x"


@asynccontextmanager
async def serving(plugin: DevicePlugin) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(plugin.serve(handle_signals=False))
    try:
        yield task
    finally:
        plugin.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)


async def streaming(kubelet: FakeKubelet, resource: str = R) -> Connection:
    connection = await wait_until(lambda: kubelet.latest(resource), what="registration")
    await wait_until(lambda: connection.latest, what="first snapshot")
    return connection


def write_non_utf8_file(directory: Path) -> None:
    """A file named b"caf\\xe9": Latin-1 "café", as an older tool may write it - not valid UTF-8."""
    with open(os.path.join(os.fsencode(directory), b"caf\xe9"), "w") as file:
        file.write("x")


async def test_non_utf8_name_in_plugin_dir_does_not_end_the_plugin(tmp_kubelet):
    """watchfiles raises an ExceptionGroup for a name it cannot decode; the plugin's watch ended, and serve() with it.
    The watch must survive and keep watching: deleting the plugin's socket afterwards still brings it back."""
    tmp, kubelet = tmp_kubelet
    plugin = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    async with serving(plugin) as task:
        await streaming(kubelet)
        write_non_utf8_file(tmp / "dp")
        await asyncio.sleep(1)  # the watch's batch (debounced) and its error handling
        assert not task.done(), f"the plugin stopped: {task.exception()!r}"

        plugin.socket_path.unlink()  # only noticed by a live watch
        await wait_until(lambda: len(kubelet.connections) == 2, what="serving again after the socket was deleted")
        assert task.done() is False and plugin.socket_path.is_socket()


async def test_a_crashed_task_is_logged_and_restarted(tmp_kubelet, monkeypatch, caplog):
    """No task dies unseen, and none ends the plugin: the watch crashing once (a fault injected into its first run)
    is logged with its traceback, and the restarted watch does its job."""
    tmp, kubelet = tmp_kubelet
    real_dir_changes = plugin_module.dir_changes
    runs = []

    def crashing_once(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("injected watch failure")
        return real_dir_changes(*args, **kwargs)

    monkeypatch.setattr(plugin_module, "dir_changes", crashing_once)
    monkeypatch.setattr(supervise, "INITIAL_BACKOFF", 0.05)
    plugin = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    with caplog.at_level(logging.ERROR, logger="deviceplane.plugin"):
        async with serving(plugin) as task:
            await streaming(kubelet)
            await wait_until(lambda: len(runs) >= 2, what="the watch restarted")
            plugin.socket_path.unlink()
            await wait_until(lambda: len(kubelet.connections) == 2, what="the restarted watch serving again")
            assert not task.done()
    (record,) = [r for r in caplog.records if "failed; restarting" in r.getMessage()]
    assert "watch" in record.getMessage() and record.exc_info is not None
    assert "injected watch failure" in str(record.exc_info[1])


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda path: os.chmod(path, 0o660), id="chmod"),
        pytest.param(lambda path: os.utime(path), id="touch"),
        pytest.param(lambda path: os.chown(path, os.getuid(), os.getgid()), id="chown"),
    ],
)
async def test_metadata_change_of_own_socket_keeps_the_stream(tmp_kubelet, change: Callable[[Path], None]):
    """A chmod/chown/touch (or an SELinux relabel) changes the socket's ctime, not the socket: the server kept
    restarting on it, cutting the kubelet's ListAndWatch stream and registering again."""
    tmp, kubelet = tmp_kubelet
    plugin = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    async with serving(plugin):
        connection = await streaming(kubelet)
        change(plugin.socket_path)
        await asyncio.sleep(3)  # past the watch's 2 s safety tick, which re-checks everything
        assert not connection.stream_ended, "the kubelet's ListAndWatch stream was cut"
        assert len(kubelet.connections) == 1, f"registered {len(kubelet.connections) - 1} more times"


async def test_another_plugin_on_our_socket_name_is_not_fought(tmp_kubelet):
    """Two plugins with one socket name (before: `<resource>-<pid>.sock`, pid 1 in two containers) deleted each other's
    socket and re-registered ~3 times a second forever. One finding the name taken serves under a new one, and
    neither deletes the other's socket."""
    tmp, kubelet = tmp_kubelet
    first = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    second = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    second.socket_path = first.socket_path
    async with serving(first):
        await wait_until(lambda: first.registrations == 1, what="first registered")
        async with serving(second):
            await wait_until(lambda: second.registrations == 1, what="second registered")
            assert second.socket_path != first.socket_path
            assert second.socket_path.name.startswith("example.com_x-")
            await asyncio.sleep(3)  # past the 2 s safety tick
            assert (first.registrations, second.registrations, len(kubelet.requests)) == (1, 1, 2)
            assert first.socket_path.is_socket() and second.socket_path.is_socket()


async def test_a_socket_replaced_by_another_process_is_left_to_it(tmp_kubelet, caplog):
    """When something else re-creates our socket's path, the plugin serves under a new name and leaves the path's
    new socket alone (it stays, and keeps its inode): taking it back would start a deletion war."""
    tmp, kubelet = tmp_kubelet
    plugin = DevicePlugin(R, [Device("d0")], plugin_dir=tmp / "dp")
    other = DevicePlugin("example.com/other", [Device("o0")], plugin_dir=tmp / "dp")
    async with serving(plugin), serving(other):
        await wait_until(lambda: plugin.registrations == 1 and other.registrations == 1, what="both registered")
        taken = plugin.socket_path
        with caplog.at_level(logging.WARNING, logger="deviceplane.plugin"):
            os.rename(other.socket_path, taken)  # another process's socket now sits at our path
            other.socket_path = taken  # (and it knows it there, as a plugin that had that name would)
            inode = taken.stat().st_ino
            await wait_until(lambda: plugin.socket_path != taken, what="moved to a new name")
            await wait_until(lambda: plugin.registrations == 2, what="registered under the new name")
        assert kubelet.requests[-1].endpoint == plugin.socket_path.name
        assert taken.stat().st_ino == inode, "the other socket was deleted or replaced"
        assert any("replaced by another process's socket" in r.getMessage() for r in caplog.records)
    assert not plugin.socket_path.exists(), "the plugin's own socket outlived it"


def test_stop_before_serve_is_not_lost():
    """stop() before serve() has set up its loop (a shutdown while the serving thread is starting) was dropped, and
    serve() then ran forever."""
    with short_tmpdir() as tmp:
        plugin = DevicePlugin("example.com/y", [Device("d0")], plugin_dir=tmp / "dp")
        plugin.stop()
        done = threading.Event()

        def run() -> None:
            asyncio.run(plugin.serve(handle_signals=False))
            done.set()

        threading.Thread(target=run, daemon=True).start()
        finished = done.wait(5)
        if not finished:
            plugin.stop()
            done.wait(5)
        assert finished, "serve() kept running after an earlier stop()"
        assert not plugin.socket_path.exists()


async def test_allocate_checks_every_container_before_any_hook(tmp_kubelet):
    """A request with one unknown id is refused as a whole - and no hook ran for the containers before it."""
    tmp, kubelet = tmp_kubelet
    calls: list[list[str]] = []

    def allocate(ids: list[str]) -> Allocation:
        calls.append(ids)
        return Allocation(envs={"X": ",".join(ids)})

    plugin = DevicePlugin(R, [Device("d0")], allocate=allocate, plugin_dir=tmp / "dp")
    async with serving(plugin):
        connection = await streaming(kubelet)
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=["d0"]),
                pb.ContainerAllocateRequest(devices_ids=["nope"]),
            ]
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connection.stub.Allocate(request, timeout=5)
        assert "non-existing device nope" in str(refused.value.details())
        assert calls == []


@pytest.mark.parametrize("answer", ["gpu-1", b"gpu-1"], ids=["str", "bytes"])
async def test_preferred_hook_returning_one_string_is_an_error(tmp_kubelet, answer):
    """A hook returning "gpu-1" instead of ["gpu-1"] was answered as five ids, one per character."""
    tmp, kubelet = tmp_kubelet
    plugin = DevicePlugin(
        R,
        [Device("gpu-0"), Device("gpu-1")],
        get_preferred_allocation=lambda available, must_include, size: answer,
        plugin_dir=tmp / "dp",
    )
    async with serving(plugin):
        connection = await streaming(kubelet)
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=["gpu-0", "gpu-1"], allocation_size=1)
            ]
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connection.stub.GetPreferredAllocation(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNKNOWN
        assert f"hook returned {type(answer).__name__}, expected a list of device ids" in str(refused.value.details())
