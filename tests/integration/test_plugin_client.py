"""The agent's plugin connection against a real plugin process (spec §6.2 endpoint_test.go)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from deviceplane.agent.plugins.plugin_client import PluginClient, PluginDialError
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.registry import Device, PluginOptions
from deviceplane.lean_grpc import RpcError
from tests.support.procs import TestPlugin

FIXED_ALLOCATE = pb.AllocateResponse(
    container_responses=[
        pb.ContainerAllocateResponse(
            devices=[
                pb.DeviceSpec(container_path="/dev/aaa", host_path="/dev/aaa", permissions="mrw"),
                pb.DeviceSpec(container_path="/dev/bbb", host_path="/dev/bbb", permissions="mrw"),
            ],
            mounts=[pb.Mount(container_path="/container_dir1/file1", host_path="host_dir1/file1", read_only=True)],
        )
    ]
)
FIXED_PREFERRED = pb.PreferredAllocationResponse(
    container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=["device0", "device1", "device2"])]
)


@pytest.fixture
def plugin(short_tmp: Path, plugin_factory: Callable[..., TestPlugin]) -> TestPlugin:
    return plugin_factory(
        short_tmp,
        "p.sock",
        [["ADeviceId", "Healthy"], ["AnotherDeviceId", "Healthy"], ["AThirdDeviceId", "Unhealthy"]],
        "--preferred",
        "--alloc-response",
        json_format.MessageToJson(FIXED_ALLOCATE),
        "--preferred-response",
        json_format.MessageToJson(FIXED_PREFERRED),
    )


async def test_new_endpoint_run_and_rpcs(plugin: TestPlugin, short_tmp: Path) -> None:
    """TestNewEndpoint + TestRun + TestAllocate + TestGetPreferredAllocation."""
    client = PluginClient("example.com/res", str(short_tmp / "p.sock"))
    options = await client.connect(timeout=5)
    assert options == PluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    snapshots: list[list[Device]] = []
    ended: list[str] = []
    got_one, got_two = asyncio.Event(), asyncio.Event()

    def on_snapshot(devices: list[Device]) -> None:
        snapshots.append(list(devices))
        (got_one if len(snapshots) == 1 else got_two).set()

    async def on_end(reason: str) -> None:
        ended.append(reason)

    client.start_stream(on_snapshot, on_end)  # type: ignore[arg-type]
    await asyncio.wait_for(got_one.wait(), 5)
    await asyncio.to_thread(
        plugin.devices, [["ADeviceId", "Unhealthy"], ["AThirdDeviceId", "Healthy"], ["AFourthDeviceId", "Healthy"]]
    )
    await asyncio.wait_for(got_two.wait(), 5)
    assert [(d.id, d.health) for d in snapshots[0]] == [
        ("ADeviceId", "Healthy"),
        ("AnotherDeviceId", "Healthy"),
        ("AThirdDeviceId", "Unhealthy"),
    ]
    assert [(d.id, d.health) for d in snapshots[1]] == [
        ("ADeviceId", "Unhealthy"),
        ("AThirdDeviceId", "Healthy"),
        ("AFourthDeviceId", "Healthy"),
    ]

    assert await client.allocate(["ADeviceId"], timeout=5) == FIXED_ALLOCATE
    assert await client.get_preferred_allocation([], [], -1, timeout=5) == FIXED_PREFERRED
    await asyncio.sleep(0.1)
    assert len(snapshots) == 2, "exactly two callbacks"
    await client.close()
    assert ended == [], "a deliberate close is not reported as a disconnect"


async def test_stream_end_is_reported(plugin: TestPlugin, short_tmp: Path) -> None:
    client = PluginClient("example.com/res", str(short_tmp / "p.sock"))
    await client.connect(timeout=5)
    ended = asyncio.Event()

    async def on_end(reason: str) -> None:
        ended.set()

    client.start_stream(lambda devices: None, on_end)
    await asyncio.to_thread(plugin.send, cmd="end-streams")
    await asyncio.wait_for(ended.wait(), 5)
    await client.close()


async def test_dial_failure_and_stopped_plugin(short_tmp: Path, plugin: TestPlugin) -> None:
    missing = PluginClient("example.com/res", str(short_tmp / "missing.sock"))
    with pytest.raises(PluginDialError, match="failed to dial device plugin"):
        await missing.connect(timeout=0.5)
    await missing.close()
    client = PluginClient("example.com/res", str(short_tmp / "p.sock"))
    await client.connect(timeout=5)
    plugin.stop()
    with pytest.raises(RpcError) as info:
        await client.allocate(["ADeviceId"], timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await client.close()


# connect() is one GetDevicePluginOptions call that waits for the connection (wait_for_ready) under one deadline.
# Its failures must read exactly as when it was a separate dial then the call: the dial error when the plugin never
# became reachable, the options error when it was reachable and did not answer. Both after the whole deadline, once.


async def timed_connect_error(client: PluginClient, timeout: float) -> tuple[str, float]:
    started = asyncio.get_running_loop().time()
    with pytest.raises(PluginDialError) as info:
        await client.connect(timeout=timeout)
    elapsed = asyncio.get_running_loop().time() - started
    await client.close()
    return str(info.value), elapsed


async def test_options_never_answered_fails_with_the_options_error_after_one_deadline(
    short_tmp: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin = plugin_factory(short_tmp, "hung.sock", [], "--hang-options")
    message, elapsed = await timed_connect_error(PluginClient("example.com/res", str(short_tmp / "hung.sock")), 2)
    # As the kubelet words it: its own prefix, then grpc-go's status error.
    assert (
        message
        == "failed to get device plugin options: rpc error: code = DeadlineExceeded desc = context deadline exceeded"
    )
    # The whole deadline was waited, and only one: not a dial deadline and then an options deadline.
    assert 2 <= elapsed < 4
    assert (await asyncio.to_thread(plugin.send, cmd="calls"))["order"] == ["GetDevicePluginOptions"]


async def test_refused_options_fail_with_the_plugins_status_as_grpc_go_prints_it(
    short_tmp: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin_factory(short_tmp, "refuses.sock", [], "--refuse-options")
    message, _ = await timed_connect_error(PluginClient("example.com/res", str(short_tmp / "refuses.sock")), 5)
    assert message == "failed to get device plugin options: rpc error: code = Unimplemented desc = no options here"


@pytest.mark.parametrize("kind", ["missing", "nobody listening", "listens, never speaks"])
async def test_unreachable_plugin_fails_with_the_dial_error_after_one_deadline(short_tmp: Path, kind: str) -> None:
    path = short_tmp / "p.sock"
    sock = socket.socket(socket.AF_UNIX)
    if kind != "missing":
        sock.bind(str(path))
    if kind == "listens, never speaks":
        sock.listen(16)
    else:
        sock.close()
    try:
        message, elapsed = await timed_connect_error(PluginClient("example.com/res", str(path)), 1)
    finally:
        sock.close()
    assert message == f"failed to dial device plugin: context deadline exceeded ({path})"
    assert 1 <= elapsed < 3


async def test_refused_list_and_watch_ends_the_stream_without_a_snapshot(
    short_tmp: Path, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin = plugin_factory(short_tmp, "p.sock", [["a", "Healthy"]], "--refuse-stream")
    client = PluginClient("example.com/res", str(short_tmp / "p.sock"))
    assert await client.connect(timeout=5) == PluginOptions()
    snapshots: list[list[Device]] = []
    ended: asyncio.Queue[str] = asyncio.Queue()
    client.start_stream(lambda devices: snapshots.append(list(devices)), ended.put)
    reason = await asyncio.wait_for(ended.get(), 10)
    assert reason == "ListAndWatch ended: PERMISSION_DENIED: no ListAndWatch for you"
    assert snapshots == []
    assert (await asyncio.to_thread(plugin.send, cmd="calls"))["order"] == ["GetDevicePluginOptions", "ListAndWatch"]
    await client.close()
