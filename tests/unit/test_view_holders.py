"""Who holds the devices in the devices view (`allocatedTo`, `allocated`): looked up only for the devices a view
lists, so a count poll (limit=0) walks no allocation, and the same answers as walking them all."""

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


class CountingPodDevices(PodDevices):
    """Counts the walks over every allocation (the cost a count poll must not pay)."""

    walks = 0

    def holder_map(self) -> dict[tuple[str, str], tuple[str, str]]:
        self.walks += 1
        return super().holder_map()


def registry(ids: list[str]) -> DeviceRegistry:
    reg = DeviceRegistry(grace_period=300)
    reg.plugin_connected(R, "/r.sock", PluginOptions(), 0.0)
    reg.apply_snapshot(R, "/r.sock", [Device(i, "Healthy") for i in ids])
    return reg


def allocate(pds: PodDevices, pod: str, container: str, *ids: str) -> None:
    pds.insert(make_allocation(pod, container, R, {0: ids}, pb.ContainerAllocateResponse()))


def test_a_count_poll_walks_no_allocation() -> None:
    pds = CountingPodDevices()
    for i in range(50):
        allocate(pds, f"p{i}", "c", f"d{i}")
    reg = registry([f"d{i}" for i in range(60)])
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, PodTable()), device_limit=0).resources
    assert (view.allocated, view.devices, pds.walks) == (50, [], 0)
    (view,) = devices_status(reg, AGENT, AllocationHolders(pds, PodTable()), device_limit=5).resources
    assert pds.walks == 1  # listing held devices walks once per view, not once per device
    assert [d.allocatedTo.pod if d.allocatedTo else None for d in view.devices] == ["p0", "p1", "p10", "p11", "p12"]


def test_free_devices_need_no_walk_and_known_pods_are_named() -> None:
    pds = CountingPodDevices()
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
    holders = AllocationHolders(pds, table)
    assert holders.holder(R, "c") is None and pds.walks == 1  # the free device asked nothing of the allocations


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
    everything = pds.holder_map()
    assert view.allocated == len({device for _resource, device in everything})
    for device in view.devices:
        expected = everything.get((R, device.id))
        got = device.allocatedTo
        assert (got.pod, got.container) == expected if got else expected is None
