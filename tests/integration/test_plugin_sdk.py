"""SDK plugins written the way users write them, run as real processes against the kubelet stand-in."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.support.plugins import wait_until
from tests.support.procs import ROOT, child_env

EXAMPLE = ROOT / "examples" / "slot_plugin.py"


@pytest.fixture
def spawn() -> AsyncIterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(script: Path, tmp: Path, **env: str) -> subprocess.Popen[str]:
        full_env = child_env() | {"DEVICEPLANE_PLUGIN_DIR": str(tmp / "dp")} | env
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=full_env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        return proc

    yield start  # type: ignore[misc]
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def allocate(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


async def test_readme_example_runs(tmp_kubelet, spawn):
    tmp, kubelet = tmp_kubelet
    state = tmp / "state"
    state.mkdir()
    proc = spawn(EXAMPLE, tmp, SLOT_STATE_DIR=str(state))
    connection = await wait_until(lambda: kubelet.latest("example.com/slot"), within=15, what="registration")
    assert await wait_until(lambda: connection.latest, what="snapshot") == {
        "slot-0": ("Healthy", (0,)),
        "slot-1": ("Healthy", (0,)),
        "slot-2": ("Healthy", (1,)),
        "slot-3": ("Healthy", (1,)),
    }
    (state / "slot-2.broken").touch()
    await wait_until(lambda: connection.latest["slot-2"][0] == "Unhealthy", within=3, what="health check")
    assert len(connection.snapshots) == 2  # unchanged health checks stream nothing
    (part,) = (await connection.stub.Allocate(allocate("slot-0", "slot-1"), timeout=5)).container_responses
    assert dict(part.envs) == {"SLOTS": "slot-0,slot-1"}
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, output
    assert "Traceback" not in output
    # The example sets up logging: without it, Python drops the SDK's INFO lines and prints WARNING and up bare.
    assert "INFO:deviceplane.plugin:example.com/slot: registered with" in output, output
    assert not connection.socket.exists()


ASYNC_PLUGIN = """
import asyncio, threading
from deviceplane.plugin import Allocation, Device, DevicePlugin, Mount

async def allocate(ids):
    if "bad" in ids:
        raise ValueError(f"cannot allocate {ids}")
    if "weird" in ids:
        return 42  # not an Allocation: the SDK must refuse it, for this call only
    if "badenv" in ids:
        return Allocation(envs={"N": 1})  # protobuf's TypeError named neither the hook nor the field
    return Allocation(envs={"IDS": ",".join(ids)}, mounts=[Mount("/c", "/h", read_only=True)],
                      cdi_devices=["v.com/x=1"])

def preferred(available, must_include, size):  # sync hook: runs in a worker thread
    return sorted(available, reverse=True)[:size]

def pre_start(ids):
    raise RuntimeError("")  # empty message: the error names the exception type

async def main():
    plugin = DevicePlugin("example.com/async", [Device("ok"), Device("bad"), Device("weird"), Device("badenv")],
                          allocate=allocate,
                          get_preferred_allocation=preferred, pre_start_container=pre_start)
    other = DevicePlugin("example.com/other", [Device("o")])
    # stop() from another thread ends serve(); the other plugin stops on SIGTERM with this one
    timer = threading.Timer(float(__import__("os").environ.get("STOP_AFTER", "3600")), other.stop)
    timer.daemon = True
    timer.start()
    await asyncio.gather(plugin.serve(), other.serve())
    print("both stopped", flush=True)

asyncio.run(main())
"""


async def test_async_plugin_hooks_and_errors(tmp_kubelet, spawn):
    tmp, kubelet = tmp_kubelet
    script = tmp / "async_plugin.py"
    script.write_text(textwrap.dedent(ASYNC_PLUGIN))
    proc = spawn(script, tmp)
    connection = await wait_until(lambda: kubelet.latest("example.com/async"), within=15, what="registration")
    await wait_until(lambda: kubelet.latest("example.com/other"), what="second plugin")
    assert connection.options == pb.DevicePluginOptions(
        pre_start_required=True, get_preferred_allocation_available=True
    )

    (part,) = (await connection.stub.Allocate(allocate("ok"), timeout=5)).container_responses
    assert dict(part.envs) == {"IDS": "ok"}
    assert [(m.container_path, m.host_path, m.read_only) for m in part.mounts] == [("/c", "/h", True)]
    assert [d.name for d in part.cdi_devices] == ["v.com/x=1"]

    refused = [
        (["ok", "bad"], "allocate: cannot allocate ['ok', 'bad']"),
        (["weird"], "allocate: hook returned int, expected Allocation or None"),
        (["badenv"], "allocate: hook returned an invalid Allocation: envs['N']: int 1, expected str"),
    ]
    for ids, message in refused:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await connection.stub.Allocate(allocate(*ids), timeout=5)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNKNOWN, message)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await connection.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["ok"]), timeout=5)
    assert err.value.details() == "pre_start_container: RuntimeError"

    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["a", "c", "b"], allocation_size=2)
        ]
    )
    response = await connection.stub.GetPreferredAllocation(request, timeout=5)
    assert list(response.container_responses[0].deviceIDs) == ["c", "b"]

    # After all those failures the plugin is still serving and its stream is open.
    (part,) = (await connection.stub.Allocate(allocate("ok"), timeout=5)).container_responses
    assert dict(part.envs) == {"IDS": "ok"}
    assert not connection.stream_ended

    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "both stopped" in output, output
    assert [p.name for p in (tmp / "dp").iterdir() if p.name != "kubelet.sock"] == []


async def test_stop_from_another_thread(tmp_kubelet, spawn):
    tmp, kubelet = tmp_kubelet
    script = tmp / "async_plugin.py"
    script.write_text(textwrap.dedent(ASYNC_PLUGIN))
    proc = spawn(script, tmp, STOP_AFTER="1")
    other = await wait_until(lambda: kubelet.latest("example.com/other"), within=15, what="registration")
    await wait_until(lambda: not other.socket.exists(), within=5, what="other plugin stopped by its timer")
    assert proc.poll() is None  # the first plugin keeps serving
    assert kubelet.latest("example.com/async").socket.exists()
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "both stopped" in output, output


BLOCKING_HOOK_PLUGIN = """
import threading
from deviceplane.plugin import Device, DevicePlugin

def allocate(ids):  # a plain hook that never returns (plain hooks run in a thread of their own: they may block)
    threading.Event().wait()

DevicePlugin("example.com/blk", [Device("d0")], allocate=allocate).run()
print("stopped", flush=True)
"""


async def test_sigterm_ends_the_process_while_a_plain_hook_blocks(tmp_kubelet, spawn):
    """asyncio.to_thread's default executor is waited for at exit: a hook blocked for good kept the process alive
    after SIGTERM, forever. Its thread is abandoned now, after the socket is removed."""
    tmp, kubelet = tmp_kubelet
    script = tmp / "blocking_plugin.py"
    script.write_text(BLOCKING_HOOK_PLUGIN)
    proc = spawn(script, tmp)
    connection = await wait_until(lambda: kubelet.latest("example.com/blk"), within=15, what="registration")
    with pytest.raises(grpc.aio.AioRpcError) as timed_out:
        await connection.stub.Allocate(allocate("d0"), timeout=1)  # the kubelet gives up; the hook stays blocked
    assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the plugin was still running 20 s after SIGTERM") from None
    assert proc.returncode == 0 and "stopped" in output, output
    assert [p.name for p in (tmp / "dp").iterdir() if p.name != "kubelet.sock"] == []
