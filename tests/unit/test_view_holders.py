"""Who holds the devices in the devices view (`allocatedTo`, `allocated`): looked up in the allocations' index for
the devices a view lists, with the same answers as walking every allocation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.models import AgentView, AllocatedTo
from deviceplane.core.pod_devices import PodDevices, make_allocation
from deviceplane.core.pod_table import PodTable
from deviceplane.core.pod_view import AllocationHolders
from deviceplane.core.pods import Container, Pod
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.view import devices_status

R = "example.com/r"
AGENT = AgentView(version="0", node="n", lastHeartbeatTime="x")


def registry(ids: list[str]) -> DeviceRegistry:
    reg = DeviceRegistry(grace_period=300)
    reg.plugin_connected(R, "/r.sock", PluginOptions(), 0.0)
    reg.apply_snapshot(R, "/r.sock", [Device(i, "Healthy") for i in ids])
    return reg


def allocate(pds: PodDevices, pod: str, container: str, *ids: str) -> None:
    pds.insert(make_allocation(pod, container, R, {0: ids}, pb.ContainerAllocateResponse()))


def test_a_view_lists_the_first_devices_by_id_with_their_holders() -> None:
    pds = PodDevices()
    for i in range(50):
        allocate(pds, f"p{i}", "c", f"d{i}")
    reg = registry([f"d{i}" for i in range(60)])
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, PodTable()), device_limit=0).resources
    assert (view.allocated, view.devices, view.devicesTruncated) == (50, [], True)
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, PodTable()), device_limit=5).resources
    assert [d.allocatedTo.pod if d.allocatedTo else None for d in view.devices] == ["p0", "p1", "p10", "p11", "p12"]
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, PodTable())).resources
    assert [d.id for d in view.devices] == sorted(f"d{i}" for i in range(60)) and not view.devicesTruncated


def test_free_devices_are_free_and_known_pods_are_named() -> None:
    pds = PodDevices()
    allocate(pds, "uid-1", "main", "a")
    allocate(pds, "uid-gone", "c", "b")  # restored from the checkpoint, no source knows it (yet)
    table = PodTable()
    main = Container(name="main", limits=((R, 1),))
    table.add(Pod("uid-1", "ml", "trainer", "Running", (), (main,)), "file", "trainer.json")
    reg = registry(["a", "b", "c"])
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, table)).resources
    assert {d.id: d.allocatedTo for d in view.devices} == {
        "a": AllocatedTo(namespace="ml", pod="trainer", container="main"),
        "b": AllocatedTo(namespace="", pod="uid-gone", container="c"),
        "c": None,
    }
    assert AllocationHolders(pds, table).holder(R, "c") is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["p1", "p2", "p3"]), st.sampled_from(["a", "b", "init"]), st.sets(st.integers(0, 9))),
        max_size=12,
    ),
    st.integers(0, 12),
)
def test_the_view_agrees_with_walking_every_allocation(
    allocations: list[tuple[str, str, set[int]]], limit: int
) -> None:
    pds = PodDevices()
    for pod, container, ids in allocations:
        if ids:
            allocate(pds, pod, container, *(f"d{i}" for i in sorted(ids)))
    reg = registry([f"d{i}" for i in range(10)])
    holders = AllocationHolders(pds, PodTable())
    (view,) = devices_status(reg, AGENT, holders, device_limit=limit).resources
    walked: dict[str, set[tuple[str, str]]] = {}  # device -> every (pod, container) holding it
    for uid in pds.pods():
        for allocation in pds.allocations(uid):
            for device_id in allocation.device_ids:
                walked.setdefault(device_id, set()).add((uid, allocation.container))
    assert view.allocated == len(walked)
    for device in view.devices:
        expected = min(walked[device.id]) if device.id in walked else None  # the smallest pair is shown
        got = device.allocatedTo
        assert (got.pod, got.container) == expected if got else expected is None
