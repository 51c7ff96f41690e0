"""PodResources' List keeps each pod's part of its answer encoded, GetAllocatableResources each resource's
(serving/podresources.py): through random admissions, phase changes, terminations, releases and removals, and random
device lists, health flips, disconnects and expiries, the kept answer must be the one built from nothing, and a
concatenation of the parts exactly what protobuf makes of the whole message. The random search did not find every
case a stale part needs (a UID listed, removed and added again, different, before the next List): those are given as
examples, each found to fail a mutation of the keeping."""

from __future__ import annotations

import asyncio

from hypothesis import example, given, settings
from hypothesis import strategies as st

from deviceplane.agent.serving.podresources import PodResourcesServicer
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
from deviceplane.core.pod_devices import PodDevices, make_allocation
from deviceplane.core.pod_table import PodTable
from deviceplane.core.pods import parse_pod
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.pods import container, pod_manifest

RESOURCES = ("example.com/gpu", "example.com/nic")
NAMES = ("a", "b")
SOURCE = "file"


def listed(servicer: PodResourcesServicer) -> bytes:
    return asyncio.run(servicer.List(pr.ListPodResourcesRequest(), None))  # type: ignore[arg-type]


# (what, pod index, a device number, a NUMA node or none)
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "admit", "allocate", "phase", "terminate", "release", "remove", "list"]),
        st.integers(0, len(NAMES) - 1),
        st.integers(0, 5),
        st.sampled_from([0, 1, NODE_WITHOUT_TOPOLOGY]),
    ),
    max_size=40,
)


# Found by hand, not by the search: a pod listed, removed and its UID added again, different, before the next List.
REUSED_UID = [("add", 0, 0, 0), ("admit", 0, 0, 0), ("list", 0, 0, 0), ("remove", 0, 0, 0), ("add", 0, 1, 0)]
# A pod listed, then its devices released and others allocated before the next List.
REALLOCATED = [("add", 1, 0, 0), ("admit", 1, 0, 0), ("allocate", 1, 2, 0), ("list", 1, 0, 0), ("release", 1, 0, 0)]


@settings(max_examples=500, deadline=None)
@given(STEPS)
@example([*REUSED_UID, ("admit", 0, 0, 0), ("list", 0, 0, 0)])
@example([*REALLOCATED, ("allocate", 1, 2, 1), ("list", 1, 0, 0)])
@example([*REALLOCATED[:4], ("allocate", 1, 1, 0), ("list", 1, 0, 0)])  # a second allocation, none released
@example([*REALLOCATED, ("list", 1, 0, 0)])  # released, nothing else
@example([("add", 0, 0, 0), ("admit", 0, 0, 0), ("list", 0, 0, 0), ("terminate", 0, 0, 0), ("list", 0, 0, 0)])
def test_the_kept_answer_is_the_one_built_from_nothing(steps: list[tuple[str, int, int, int]]) -> None:
    table, pod_devices, registry = PodTable(), PodDevices(), DeviceRegistry(300.0)
    servicer = PodResourcesServicer(table, pod_devices, registry)
    for what, index, device, numa in steps:
        name = NAMES[index]
        record = table.get(f"uid-{name}")
        if what == "add" and record is None:
            spec = pod_manifest(
                name,
                [container("main", {RESOURCES[0]: 1}), container("side", {RESOURCES[1]: 1})],
                init=[container("sidecar", {RESOURCES[1]: 1}, restart_policy="Always"), container("setup")],
                uid=f"uid-{name}",
                namespace="ns" if device % 2 else "default",  # a UID re-added later may differ
            )
            table.add(parse_pod(spec, source=SOURCE), SOURCE, name)
        elif record is None or what == "list":
            pass
        elif what == "admit":
            record.admitted(restored=False)
        elif what == "allocate":
            where = ("main", "side", "sidecar", "setup")[device % 4]
            resource = RESOURCES[device % 2]
            per_numa = {numa: (f"dev{device}",)}
            pod_devices.insert(
                make_allocation(record.pod.uid, where, resource, per_numa, pb.ContainerAllocateResponse())
            )
        elif what == "phase":
            record.phase_changed(("Pending", "Running")[device % 2])
        elif what == "terminate":
            record.terminated("ended")
        elif what == "release":
            pod_devices.remove_pod(record.pod.uid)
        elif what == "remove":
            table.remove_at(SOURCE, name)
            pod_devices.remove_pod(record.pod.uid)
        if what == "list":  # a client's call, between any changes
            check(servicer, table, pod_devices, registry)
    check(servicer, table, pod_devices, registry)


def check(servicer: PodResourcesServicer, table: PodTable, pod_devices: PodDevices, registry: DeviceRegistry) -> None:
    kept = listed(servicer)
    fresh = listed(PodResourcesServicer(table, pod_devices, registry))
    assert kept == fresh
    whole = pr.ListPodResourcesResponse.FromString(fresh)
    assert whole.SerializeToString() == fresh  # the parts' concatenation is the message's own encoding
    assert [p.name for p in whole.pod_resources] == [r.pod.name for r in table.active()]


def allocatable(servicer: PodResourcesServicer) -> bytes:
    return asyncio.run(servicer.GetAllocatableResources(pr.AllocatableResourcesRequest(), None))  # type: ignore[arg-type]


DEVICE_LISTS = st.dictionaries(
    st.sampled_from(["d1", "d2", "d10", "x"]),
    st.tuples(st.sampled_from(["Healthy", "Unhealthy"]), st.sampled_from([(), (0,), (1,), (0, 1)])),
    max_size=4,
)
PLUGIN_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["connect", "snapshot", "resend", "disconnect", "expire", "ask"]),
        st.sampled_from(RESOURCES),
        DEVICE_LISTS,
    ),
    max_size=30,
)


GPU = RESOURCES[0]
ASK = ("ask", GPU, {})
ASKED = [("connect", GPU, {}), ("snapshot", GPU, {"d1": ("Healthy", (0,)), "d2": ("Unhealthy", ())}), ASK]


@settings(max_examples=300, deadline=None)
@given(PLUGIN_STEPS)
@example([*ASKED, ("snapshot", GPU, {"d1": ("Healthy", (1,))}), ASK])  # the same ID and health, another NUMA node
@example([*ASKED, ("disconnect", GPU, {}), ASK])  # every device unhealthy, the same devices
@example([*ASKED, ("disconnect", GPU, {}), ("expire", GPU, {}), ASK])  # the resource gone
def test_the_kept_allocatable_answer_is_the_one_built_from_nothing(
    steps: list[tuple[str, str, dict[str, tuple[str, tuple[int, ...]]]]],
) -> None:
    registry = DeviceRegistry(300.0)
    servicer = PodResourcesServicer(PodTable(), PodDevices(), registry)
    now, last = 0.0, {}
    for what, resource, devices in steps:
        now += 1.0
        if what == "connect" and "/s" not in registry.connected_sockets(resource):
            registry.plugin_connected(resource, "/s", PluginOptions(), now)
        elif what == "snapshot":
            last[resource] = [Device(i, health, numa) for i, (health, numa) in devices.items()]
            registry.apply_snapshot(resource, "/s", last[resource])
        elif what == "resend" and resource in last:
            registry.apply_snapshot(resource, "/s", list(last[resource]))
        elif what == "disconnect":
            registry.plugin_disconnected(resource, "/s", now)
        elif what == "expire":
            now += 301.0
            registry.expire(now)
        elif what == "ask":
            check_allocatable(servicer, registry)
    check_allocatable(servicer, registry)


def check_allocatable(servicer: PodResourcesServicer, registry: DeviceRegistry) -> None:
    kept = allocatable(servicer)
    fresh = allocatable(PodResourcesServicer(PodTable(), PodDevices(), registry))
    assert kept == fresh
    whole = pr.AllocatableResourcesResponse.FromString(fresh)
    assert whole.SerializeToString() == fresh
    expected = sorted(  # from the registry's state itself, not through what the servicer calls
        (state.name, device_id, numa)
        for state in registry.statuses()
        for device_id, device in state.all_devices.items()
        if device_id in state.healthy
        for numa in device.numa_nodes or (None,)
    )
    got = [
        (d.resource_name, d.device_ids[0], d.topology.nodes[0].ID if d.HasField("topology") else None)
        for d in whole.devices
    ]
    assert sorted(got, key=str) == sorted(expected, key=str) and len(got) == len(expected)
