"""The kubelet's counting of a ListAndWatch message (core/device_sets.py), against a line-by-line transcription of
the spec's algorithm (§4.4 genericDeviceUpdateCallback, §4.4 markResourceUnhealthy, §4.5 GetCapacity); and proxy
mode's path to the view (core.snapshot.as_sent, the registry, the view), which must count as the kubelet does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.agent.plugins.plugin_client import devices_from_proto
from deviceplane.agent.proxy.feed import all_unhealthy
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.models import AgentView, DeviceView
from deviceplane.core.device_sets import device_sets, kubelet_counts
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.snapshot import REPEATED, as_sent, checked_snapshot
from deviceplane.core.topology import MAX_NUMA_NODES
from deviceplane.core.view import devices_status, resource_counts
from tests.support.fuzz import fuzz_settings

R = "example.com/r"
SOCKET = "/r.sock"
# A small alphabet so that IDs repeat; health strings around "Healthy"; NUMA IDs around 64 and over int64.
IDS = st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=3))
HEALTH = st.one_of(st.sampled_from(["Healthy", "Unhealthy", "healthy", "", "Healthy ", "HEALTHY"]), st.text(max_size=3))
NUMA = st.one_of(st.integers(-2, 3), st.integers(60, 70), st.integers(-(2**63), 2**63 - 1))
DEVICES = st.lists(st.builds(Device, IDS, HEALTH, st.lists(NUMA, max_size=2).map(tuple)), max_size=8)


class Kubelet(NamedTuple):
    all_devices: dict[str, Device]
    healthy: set[str]
    unhealthy: set[str]
    capacity: int
    allocatable: int


def spec_message(devices: Sequence[Device]) -> Kubelet:
    """§4.4 genericDeviceUpdateCallback steps 1-2, then §4.5 GetCapacity for a resource whose endpoint is live."""
    # 1. reset healthyDevices[resource], unhealthyDevices[resource], allDevices[resource]
    all_devices: dict[str, Device] = {}
    healthy_devices: set[str] = set()
    unhealthy_devices: set[str] = set()
    # 2. for each device: allDevices[resource][ID] = dev; "Healthy" (exact) -> healthy, otherwise -> unhealthy
    for dev in devices:
        all_devices[dev.id] = dev
        if dev.health == "Healthy":
            healthy_devices.add(dev.id)
        else:
            unhealthy_devices.add(dev.id)
    return spec_capacity(all_devices, healthy_devices, unhealthy_devices)


def spec_capacity(all_devices: dict[str, Device], healthy_devices: set[str], unhealthy_devices: set[str]) -> Kubelet:
    # GetCapacity: for each resource in healthyDevices, capacity[r] = allocatable[r] = len(healthy); for each resource
    # in unhealthyDevices, capacity[r] += len(unhealthy)
    capacity = allocatable = len(healthy_devices)
    capacity += len(unhealthy_devices)
    return Kubelet(all_devices, healthy_devices, unhealthy_devices, capacity, allocatable)


def spec_allocatable(kubelet: Kubelet) -> dict[str, Device]:
    """§4.13 GetAllocatableDevices: allDevices filtered to healthyDevices (the map's device, the last copy sent)."""
    return {device_id: dev for device_id, dev in kubelet.all_devices.items() if device_id in kubelet.healthy}


def listed_as_the_kubelet_lists(shown: Sequence[DeviceView], kubelet: Kubelet) -> None:
    """Each ID listed once (allDevices) with its last copy's NUMA nodes; an allocatable one with the health string
    GetAllocatableDevices gives it, any other Unhealthy."""
    assert {d.id for d in shown} == set(kubelet.all_devices)
    allocatable = spec_allocatable(kubelet)
    for device in shown:
        assert tuple(device.numaNodes) == kubelet.all_devices[device.id].numa_nodes
        listed = allocatable.get(device.id)
        assert device.health == (listed.health if listed is not None else "Unhealthy"), (device, kubelet)


def spec_disconnect(before: Kubelet) -> Kubelet:
    """§4.4 markResourceUnhealthy: every healthy ID moves to unhealthy; allDevices unchanged."""
    return spec_capacity(before.all_devices, set(), before.unhealthy | before.healthy)


@fuzz_settings(bounded=300, long=50_000)
@given(DEVICES)
def test_device_sets_are_the_kubelets(devices: list[Device]) -> None:
    kubelet = spec_message(devices)
    sets = device_sets(devices)
    assert (sets.devices, sets.healthy, sets.unhealthy) == kubelet[:3]
    assert kubelet_counts(sets.healthy, sets.unhealthy) == (kubelet.capacity, kubelet.allocatable)


def agent_counts(registry: DeviceRegistry) -> tuple[int, int, int, int]:
    """(capacity, allocatable) as the registry gives them, and (capacity, healthy) as the view and conditions do."""
    state = registry.resource(R)
    assert state is not None
    counts = resource_counts(state)
    capacity = registry.capacity()
    return capacity.capacity[R], capacity.allocatable[R], counts.capacity, counts.healthy


@fuzz_settings(bounded=300, long=50_000)
@given(st.lists(DEVICES, min_size=1, max_size=3))
def test_proxy_modes_view_counts_every_snapshot_as_the_kubelet(snapshots: list[list[Device]]) -> None:
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, SOCKET, PluginOptions(), 0.0)
    for devices in snapshots:
        taken, _problems = as_sent(devices)
        assert taken == devices  # the kubelet's message, unchanged
        registry.apply_snapshot(R, SOCKET, taken)
        kubelet = spec_message(devices)
        want = (kubelet.capacity, kubelet.allocatable)
        assert agent_counts(registry) == want * 2

        (shown,) = devices_status(registry, AgentView(version="0", node="n", lastHeartbeatTime="x")).resources
        assert (shown.capacity, shown.allocatable, shown.healthy) == (*want, kubelet.allocatable)
        assert shown.unhealthy == len(kubelet.unhealthy)
        listed_as_the_kubelet_lists(shown.devices, kubelet)

    registry.plugin_disconnected(R, SOCKET, 1.0)
    gone = spec_disconnect(spec_message(snapshots[-1]))
    assert agent_counts(registry) == (gone.capacity, gone.allocatable) * 2
    (shown,) = devices_status(registry, AgentView(version="0", node="n", lastHeartbeatTime="x")).resources
    listed_as_the_kubelet_lists(shown.devices, gone)  # nothing allocatable: every device Unhealthy
    # The kubelet's stream then gets every device Unhealthy (proxy/feed.py): the same counts from that message.
    topologies = [pb.TopologyInfo(nodes=[pb.NUMANode(ID=n) for n in d.numa_nodes]) for d in snapshots[-1]]
    last = pb.ListAndWatchResponse(
        devices=[
            pb.Device(ID=d.id, health=d.health, topology=topology if d.numa_nodes else None)
            for d, topology in zip(snapshots[-1], topologies, strict=True)
        ]
    )
    resent = devices_from_proto(all_unhealthy(last).devices)
    assert (spec_message(resent).capacity, spec_message(resent).allocatable) == (gone.capacity, gone.allocatable)


def test_an_id_sent_healthy_then_otherwise_is_listed_with_its_last_copys_health() -> None:
    """The kubelet allocates such a device (its ID is in the healthy set) and GetAllocatableDevices lists it with its
    last copy: so does proxy mode's view; it counts in allocatable and healthy, and in unhealthy too."""
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, SOCKET, PluginOptions(), 0.0)
    sent = [Device("a", "Healthy"), Device("a", "Unhealthy", (1,)), Device("b", "Healthy"), Device("c", "Healthy"),
            Device("c", "", ()), Device("d", "healthy"), Device("d", "Healthy", (0,))]  # fmt: skip
    registry.apply_snapshot(R, SOCKET, as_sent(sent)[0])
    (shown,) = devices_status(registry, AgentView(version="0", node="n", lastHeartbeatTime="x")).resources
    assert [(d.id, d.health, d.numaNodes) for d in shown.devices] == [
        ("a", "Unhealthy", [1]),
        ("b", "Healthy", []),
        ("c", "", []),
        ("d", "Healthy", [0]),
    ]
    assert (shown.capacity, shown.allocatable, shown.healthy, shown.unhealthy) == (7, 4, 4, 3)


@fuzz_settings(bounded=300, long=50_000)
@given(st.lists(DEVICES, min_size=1, max_size=3))
def test_agent_modes_view_lists_only_healthy_and_unhealthy(snapshots: list[list[Device]]) -> None:
    """Agent mode corrects each snapshot first (one copy of each ID, NUMA IDs >= 64 Unhealthy): its view lists
    Healthy exactly for the devices it counts healthy, Unhealthy for the rest, as before proxy mode's listing."""
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, SOCKET, PluginOptions(), 0.0)
    for devices in snapshots:
        corrected, _problems = checked_snapshot(devices)
        registry.apply_snapshot(R, SOCKET, corrected)
        state = registry.resource(R)
        assert state is not None
        (shown,) = devices_status(registry, AgentView(version="0", node="n", lastHeartbeatTime="x")).resources
        assert {d.id: d.health for d in shown.devices} == {
            d.id: "Healthy" if d.id in state.healthy else "Unhealthy" for d in corrected
        }
        last = {d.id: d for d in devices}  # the last copy of each ID counts
        assert {d.id for d in shown.devices if d.health == "Healthy"} == {
            i for i, d in last.items() if d.health == "Healthy" and not (d.numa_nodes and max(d.numa_nodes) >= 64)
        }


@fuzz_settings(bounded=300, long=50_000)
@given(DEVICES)
def test_as_sent_finds_what_agent_mode_corrects_and_changes_nothing(devices: list[Device]) -> None:
    taken, problems = as_sent(devices)
    assert taken == devices
    _, corrected = checked_snapshot(devices)
    repeated = [device for device, reason in problems if reason.startswith(REPEATED)]
    assert repeated == [device for device, reason in corrected if reason.startswith(REPEATED)]
    out_of_range = [device for device, reason in problems if reason.startswith("NUMA node id")]
    assert out_of_range == [d for d in devices if d.numa_nodes and max(d.numa_nodes) >= MAX_NUMA_NODES]


def test_as_sent_says_what_the_kubelet_makes_of_each_problem() -> None:
    devices = [Device("a", "Healthy"), Device("b", "Healthy", (0, 70)), Device("a", "Unhealthy")]
    assert as_sent(devices) == (
        devices,
        [
            (Device("a", "Healthy"), "device id sent more than once; counted as the kubelet counts it, twice in "
             "capacity if its copies' health differs"),
            (Device("b", "Healthy", (0, 70)), "NUMA node id 70 is out of range (ids must be below 64); the kubelet "
             "gets it as sent and counts the device by its health"),
        ],
    )  # fmt: skip
    # The kubelet's counts of it: a in both sets.
    assert kubelet_counts(*device_sets(devices)[1:]) == (3, 2)
