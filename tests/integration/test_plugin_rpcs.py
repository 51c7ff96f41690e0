"""The DevicePlugin RPCs of the sim plugin, dialled directly like the kubelet does, over its real socket."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import grpc
import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.support.plugins import Connection, FakeKubelet, PluginProcess, connect, short_tmpdir, wait_until


@pytest.fixture
async def env() -> AsyncIterator[tuple[PluginProcess, Connection, FakeKubelet]]:
    """A registered sim plugin (8 devices on 2 NUMA nodes) and the kubelet stand-in's connection to it."""
    with short_tmpdir() as tmp:
        kubelet = await FakeKubelet(tmp / "dp").start()
        proc = PluginProcess(tmp, "sim", "--plugin-dir", str(tmp / "dp"), "--count", "8", "--numa", "2",
                             "--control", "127.0.0.1:0")  # fmt: skip
        try:
            connection = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
            await wait_until(lambda: connection.latest, what="first snapshot")
            yield proc, connection, kubelet
        finally:
            proc.kill()
            await kubelet.stop()


def allocate_request(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers])


async def test_two_list_and_watch_clients_get_every_update(env):
    proc, registered, _ = env
    clients = [await connect("example.com/sim", registered.socket) for _ in range(2)]
    try:
        for client in clients:
            await wait_until(lambda c=client: c.latest, what="first snapshot")
        flips = [("sim-1", False), ("sim-6", False), ("sim-1", True), ("sim-3", False), ("sim-6", True)]
        for device_id, healthy in flips:
            proc.control("POST", f"/devices/{device_id}/{'healthy' if healthy else 'unhealthy'}")
        expected_last = {f"sim-{i}": ("Healthy", (i // 4,)) for i in range(8)} | {"sim-3": ("Unhealthy", (0,))}
        for client in [*clients, registered]:
            await wait_until(lambda c=client: c.latest == expected_last, within=2, what="all updates")
            # First the initial snapshot, then exactly one snapshot per update, in order.
            assert len(client.snapshots) == 1 + len(flips)
            health = {f"sim-{i}": "Healthy" for i in range(8)}
            for snapshot, (device_id, healthy) in zip(client.snapshots[1:], flips, strict=True):
                health[device_id] = "Healthy" if healthy else "Unhealthy"
                assert {k: v[0] for k, v in snapshot.items()} == health
    finally:
        for client in clients:
            await client.close()


async def test_late_client_gets_current_snapshot_first(env):
    proc, registered, _ = env
    proc.control("POST", "/health", {"sim-0": False, "sim-7": False})
    await wait_until(lambda: registered.latest["sim-0"][0] == "Unhealthy", what="update")
    late = await connect("example.com/sim", registered.socket)
    try:
        first = await wait_until(lambda: late.latest, what="first snapshot")
        assert first["sim-0"][0] == first["sim-7"][0] == "Unhealthy"
        assert len(late.snapshots) == 1
    finally:
        await late.close()


async def test_fifty_concurrent_allocates(env):
    proc, connection, _ = env
    requests = [allocate_request([f"sim-{i % 8}", f"sim-{(i + 3) % 8}"]) for i in range(50)]
    responses = await asyncio.gather(*(connection.stub.Allocate(r, timeout=10) for r in requests))
    for request, response in zip(requests, responses, strict=True):
        ids = list(request.container_requests[0].devices_ids)
        (part,) = response.container_responses
        assert dict(part.envs) == {"SIM_DEVICES": ",".join(ids)}
        assert [(d.container_path, d.host_path, d.permissions) for d in part.devices] == [
            (f"/dev/{i}", "/dev/null", "rw") for i in ids
        ]
    calls = proc.control("GET", "/calls")
    assert calls["counts"]["Allocate"] == 50
    assert sorted(tuple(c["devices_ids"]) for c in calls["Allocate"]) == sorted(
        tuple(r.container_requests[0].devices_ids) for r in requests
    )


async def test_allocate_answers_each_container(env):
    _, connection, _ = env
    response = await connection.stub.Allocate(allocate_request(["sim-0"], ["sim-4", "sim-5"]), timeout=5)
    assert [dict(c.envs) for c in response.container_responses] == [
        {"SIM_DEVICES": "sim-0"},
        {"SIM_DEVICES": "sim-4,sim-5"},
    ]


async def test_failing_hook_fails_only_that_call(env):
    proc, connection, _ = env
    proc.control("PUT", "/faults/Allocate", {"mode": "fail", "message": "device on fire", "times": 1})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await connection.stub.Allocate(allocate_request(["sim-2"]), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert "device on fire" in (err.value.details() or "")
    # The next call, other RPCs and the open stream are unaffected.
    response = await connection.stub.Allocate(allocate_request(["sim-2"]), timeout=5)
    assert dict(response.container_responses[0].envs) == {"SIM_DEVICES": "sim-2"}
    await connection.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["sim-2"]), timeout=5)
    proc.control("POST", "/devices/sim-2/unhealthy")
    await wait_until(lambda: connection.latest["sim-2"][0] == "Unhealthy", within=2, what="stream still alive")
    assert not connection.stream_ended


async def test_allocate_refuses_unhealthy_devices_and_pre_start_unknown_ones(env):
    """As the kubelet's sample plugin (spec §7.2): an unhealthy device is refused before any hook runs; and
    PreStartContainer, like Allocate, hands its hook only devices the plugin lists."""
    proc, connection, _ = env
    proc.control("POST", "/devices/sim-3/unhealthy")
    await wait_until(lambda: connection.latest["sim-3"][0] == "Unhealthy", what="sim-3 unhealthy")
    refusals = [
        (connection.stub.Allocate(allocate_request(["sim-2"], ["sim-3"]), timeout=5),
         "invalid allocation request with unhealthy device: sim-3"),
        (connection.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["sim-1", "sim-99"]), timeout=5),
         "invalid pre-start request with non-existing device sim-99"),
    ]  # fmt: skip
    for call, message in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNKNOWN, message)
    assert proc.control("GET", "/calls")["counts"] == {
        "Allocate": 0,
        "GetPreferredAllocation": 0,
        "PreStartContainer": 0,
    }
    # A device that is back to healthy is allocated again.
    proc.control("POST", "/devices/sim-3/healthy")
    await wait_until(lambda: connection.latest["sim-3"][0] == "Healthy", what="sim-3 healthy")
    response = await connection.stub.Allocate(allocate_request(["sim-3"]), timeout=5)
    assert dict(response.container_responses[0].envs) == {"SIM_DEVICES": "sim-3"}


async def test_hanging_hook_only_blocks_its_caller(env):
    proc, connection, _ = env
    proc.control("PUT", "/faults/Allocate", {"mode": "hang", "times": 1})
    hanging = asyncio.ensure_future(connection.stub.Allocate(allocate_request(["sim-1"]), timeout=3))
    await wait_until(lambda: proc.control("GET", "/calls")["counts"]["Allocate"] == 1, what="hanging call")
    response = await connection.stub.Allocate(allocate_request(["sim-2"]), timeout=2)
    assert dict(response.container_responses[0].envs) == {"SIM_DEVICES": "sim-2"}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await hanging
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_preferred_allocation_packs_one_numa_node(env):
    proc, connection, _ = env
    request = pb.PreferredAllocationRequest(
        container_requests=[
            # node 0: sim-0..3, node 1: sim-4..7. Both hold 2; node 0, with fewer free, is the best fit.
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=["sim-0", "sim-2", "sim-4", "sim-5", "sim-6"], allocation_size=2
            ),
            # sim-5 is on node 1: its free sim-4 first, then one from node 0.
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=["sim-0", "sim-2", "sim-3", "sim-4", "sim-5"],
                must_include_deviceIDs=["sim-5"],
                allocation_size=3,
            ),
        ]
    )
    response = await connection.stub.GetPreferredAllocation(request, timeout=5)
    assert [list(c.deviceIDs) for c in response.container_responses] == [
        ["sim-0", "sim-2"],
        ["sim-5", "sim-4", "sim-0"],
    ]
    recorded = proc.control("GET", "/calls")["GetPreferredAllocation"]
    assert [(r["allocation_size"], r["must_include_deviceIDs"], r["result"]) for r in recorded] == [
        (2, [], ["sim-0", "sim-2"]),
        (3, ["sim-5"], ["sim-5", "sim-4", "sim-0"]),
    ]


async def test_pre_start_container_is_recorded_and_resettable(env):
    proc, connection, _ = env
    for ids in (["sim-1"], ["sim-2", "sim-3"]):
        await connection.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=5)
    calls = proc.control("GET", "/calls")
    assert calls["counts"]["PreStartContainer"] == 2
    assert [c["devices_ids"] for c in calls["PreStartContainer"]] == [["sim-1"], ["sim-2", "sim-3"]]
    proc.control("DELETE", "/calls")
    assert proc.control("GET", "/calls")["counts"] == {
        "Allocate": 0,
        "GetPreferredAllocation": 0,
        "PreStartContainer": 0,
    }


async def test_control_rejects_bad_requests(env):
    proc, _, _ = env
    with pytest.raises(AssertionError, match=r"404.*no such device: sim-99"):
        proc.control("POST", "/devices/sim-99/unhealthy")
    with pytest.raises(AssertionError, match="400"):
        proc.control("PUT", "/faults/Allocate", {"mode": "explode"})
    with pytest.raises(AssertionError, match="404"):
        proc.control("PUT", "/faults/Nope", {"mode": "fail"})
    with pytest.raises(AssertionError, match="400"):
        proc.control("PUT", "/flap", {"rate": -1})
    # NaN seconds passed `< 0` and hung for no time, `true` was 1 time, a rate of 1e9 spun a core.
    bad = [
        ("/faults/Allocate", {"mode": "hang", "seconds": float("nan")}, "seconds must be a number from 0 to 86400"),
        ("/faults/Allocate", {"mode": "hang", "seconds": 1e12}, "seconds must be a number from 0 to 86400"),
        ("/faults/Allocate", {"mode": "fail", "times": True}, "times must be an integer from 1 to 1000000"),
        ("/faults/Allocate", {"mode": "fail", "message": 5}, "message must be a string, got 5"),
        ("/flap", {"rate": 1e9}, "rate must be a number of flips per second from 0 to 1000, got 1000000000.0"),
        ("/flap", {"rate": True}, "rate must be a number of flips per second from 0 to 1000, got True"),
    ]
    for path, body, message in bad:
        with pytest.raises(AssertionError, match=rf"400 .*{re.escape(message)}"):
            proc.control("PUT", path, body)
    assert proc.control("GET", "/faults") == {}
    assert proc.control("GET", "/devices")["flapRate"] == 0


async def test_flapping_changes_health_over_time(env):
    proc, connection, _ = env
    proc.control("PUT", "/flap", {"rate": 20})
    await wait_until(lambda: len(connection.snapshots) >= 5, within=3, what="flips streamed")
    proc.control("PUT", "/flap", {"rate": 0})
    assert proc.control("GET", "/devices")["flips"] >= 4
