"""Fuzzing ListAndWatch snapshots at the conversion boundary (proto devices -> what the registry is given), then
through the registry, the devices view and an admission under a topology policy: whatever a plugin sends (ids,
health strings, NUMA ids over the whole int64 range, duplicates), the sets stay consistent, only Healthy devices
with representable topology are allocatable, hints stay within the machine's nodes, and the view renders."""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.agent.plugins.plugin_client import devices_from_proto
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.models import AgentView
from deviceplane.core.admission_plan import AllocateCall, admit_pod
from deviceplane.core.allocator import AllocationError, Allocator
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pods import Container, Pod
from deviceplane.core.registry import DeviceRegistry, PluginOptions
from deviceplane.core.snapshot import checked_snapshot
from deviceplane.core.topology import MAX_NUMA_NODES, POLICIES
from deviceplane.core.view import devices_status
from tests.support.fuzz import fuzz_settings

R = "example.com/fz"
INT64 = st.integers(-(2**63), 2**63 - 1)
NUMA_ID = st.one_of(st.integers(-2, 3), st.integers(60, 70), INT64)
# "\u00b9" (a digit to str.isdigit(), not to int()) and a 5,000-digit run broke natural ordering (long run, 8,521st)
IDS = st.one_of(st.sampled_from(["a", "b", "c", "d", "e", "\u00b9", "x\u0661", "d" + "9" * 5000]), st.text(max_size=8))
HEALTH = st.one_of(st.sampled_from(["Healthy", "Unhealthy", "healthy", "", " Healthy"]), st.text(max_size=6))
DEVICE = st.builds(
    lambda i, h, nodes: pb.Device(ID=i, health=h, topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in nodes])),
    IDS,
    HEALTH,
    st.lists(NUMA_ID, max_size=3),
)
SNAPSHOTS = st.lists(st.lists(DEVICE, max_size=8), min_size=1, max_size=3)


def drive(allocator: Allocator, pod: Pod, policy: str, numa: list[int]) -> set[str]:
    steps = admit_pod(allocator, pod, policy, numa)
    chosen: set[str] = set()
    try:
        step = next(steps)
        while True:
            if isinstance(step, AllocateCall):
                chosen |= set(step.devices)
                step = steps.send(pb.ContainerAllocateResponse())
            else:
                step = steps.send(set(step.request.available[: step.request.size]))
    except StopIteration:
        return chosen
    except AllocationError:
        return set()


@fuzz_settings(bounded=500, long=30_000)
@given(SNAPSHOTS, st.sampled_from(POLICIES), st.integers(1, 4), st.integers(0, 3))
def test_fuzz_list_and_watch_snapshots(snapshots: list[list[pb.Device]], policy: str, nodes: int, want: int) -> None:
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, "/fz.sock", PluginOptions(), 0.0)
    for message in snapshots:
        devices, _problems = checked_snapshot(devices_from_proto(pb.ListAndWatchResponse(devices=message).devices))
        registry.apply_snapshot(R, "/fz.sock", devices)
    last = {d.ID: d for d in snapshots[-1]}  # a repeated id: the last one counts
    state = registry.resource(R)
    assert state is not None
    assert set(state.all_devices) == set(last)
    assert state.healthy.isdisjoint(state.unhealthy)
    assert state.healthy | state.unhealthy == set(last)
    for device_id, sent in last.items():
        representable = all(n.ID < MAX_NUMA_NODES for n in sent.topology.nodes)
        assert (device_id in state.healthy) == (sent.health == "Healthy" and representable)
    capacity = registry.capacity()
    assert capacity.capacity[R] == len(last) and capacity.allocatable[R] == len(state.healthy)

    view = devices_status(registry, AgentView(version="0", node="n", lastHeartbeatTime="x"), device_limit=3)
    rendered = json.loads(json.dumps(view.model_dump(mode="json")))
    assert len(rendered["resources"][0]["devices"]) == min(3, len(last))
    # the view's counts are the registry's capacity (the node's capacity and allocatable), judged from the state
    counted = rendered["resources"][0]
    assert (counted["capacity"], counted["allocatable"]) == (capacity.capacity[R], capacity.allocatable[R])

    numa = list(range(nodes))
    pod = Pod("uid", "default", "p", "Pending", (), (Container("c", ((R, want),)),))
    started = time.monotonic()
    chosen = drive(Allocator(registry, PodDevices()), pod, policy, numa)
    assert time.monotonic() - started < 5  # bounded work, whatever the NUMA ids
    assert chosen <= state.healthy
    assert len(chosen) in (0, want)
