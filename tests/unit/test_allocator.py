"""devicesToAllocate, filterByAffinity, init-container reuse and the admission step machine (spec §4.7, §6.1)."""

from __future__ import annotations

import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.admission_plan import AllocateCall, PreferredCall, admit_pod, pre_start_calls
from deviceplane.core.allocator import AllocationError, AskPreferred, Chosen, filter_by_affinity, natural_sorted
from deviceplane.core.pod_devices import PodDevices, devices_per_numa, make_allocation
from deviceplane.core.registry import Device, PluginOptions
from deviceplane.core.topology import mask_of
from tests.unit.alloc_helpers import R1, R2, R3, allocator_with, ctr, drive, pod


def test_pod_container_device_allocation() -> None:
    """TestPodContainerDeviceAllocation (§6.1 item 11)."""
    alloc = allocator_with(
        {R1: [("dev1", "Healthy", (0,)), ("dev2", "Healthy", (1,))], R2: [("dev3", "Healthy"), ("dev4", "Healthy")]}
    )
    drive(alloc, pod("A", ctr("a", {R1: 2, "cpu": 2, R2: 1})))
    assert alloc.pod_devices.allocated_count(R1) == 2
    assert alloc.pod_devices.allocated_count(R2) == 1
    with pytest.raises(AllocationError) as err:
        drive(alloc, pod("B", ctr("b", {R1: 1})))
    assert str(err.value) == f"requested number of devices unavailable for {R1}. Requested: 1, Available: 0"
    assert alloc.pod_devices.run_options("B", "b") is None
    drive(alloc, pod("C", ctr("c", {R2: 1})))
    assert alloc.pod_devices.allocated_count(R2) == 2
    options = alloc.pod_devices.run_options("C", "c")
    assert options is not None and len(options.envs) == 1 and not options.mounts and not options.devices


def test_devices_to_allocate_errors_in_upstream_order() -> None:
    """TestPodContainerDeviceToAllocate (§6.1 item 12): exact strings."""
    alloc = allocator_with({R1: [], R3: [("dev7", "Healthy"), ("dev8", "Healthy")]})
    with pytest.raises(AllocationError, match=f"^no healthy devices present; cannot allocate unhealthy devices {R1}$"):
        alloc.devices_to_allocate("p", "c", R1, 0)
    with pytest.raises(AllocationError, match=f"^cannot allocate unregistered device {R2}$"):
        alloc.devices_to_allocate("p", "c", R2, 1)
    alloc.pod_devices.insert(make_allocation("p", "c", R3, {-1: ("dev5",)}, pb.ContainerAllocateResponse()))
    with pytest.raises(AllocationError) as err:
        alloc.devices_to_allocate("p", "c", R3, 1)
    assert str(err.value) == (
        f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {R3}"
    )
    with pytest.raises(AllocationError) as err:
        alloc.devices_to_allocate("p", "c", R3, 2)
    assert str(err.value) == f'pod "p" container "c" changed request for resource "{R3}" from 1 to 2'


def test_steady_state_container_needs_nothing() -> None:
    alloc = allocator_with({R1: [("d1", "Healthy"), ("d2", "Healthy")]})
    drive(alloc, pod("p", ctr("c", {R1: 1})))
    assert alloc.devices_to_allocate("p", "c", R1, 1) == Chosen(())


def test_filter_by_affinity_upstream_example() -> None:
    """TestFilterByAffinity (§6.1 item 10): hint {2}."""
    devices = {
        "dev1": Device("dev1", "Healthy", (1,)),
        "dev2": Device("dev2", "Healthy", (1, 2)),
        "dev3": Device("dev3", "Healthy", (2,)),
        "dev4": Device("dev4", "Healthy", (2,)),
        "dev5": Device("dev5", "Healthy"),
    }
    assert filter_by_affinity(mask_of([2]), devices, {"dev1", "dev2"}) == ({"dev2"}, {"dev1"}, set())
    assert filter_by_affinity(mask_of([2]), devices, {"dev1", "dev2", "dev3", "dev4"}) == (
        {"dev2", "dev3", "dev4"},
        {"dev1"},
        set(),
    )
    assert filter_by_affinity(mask_of([2]), devices, {"dev5"}) == (set(), set(), {"dev5"})
    assert filter_by_affinity(None, devices, {"dev1", "dev5"}) == (set(), set(), {"dev1", "dev5"})


def test_init_container_devices_are_reused() -> None:
    """TestInitContainerDeviceAllocation (§6.1 item 15)."""
    alloc = allocator_with(
        {R1: [(f"dev{i}", "Healthy") for i in range(1, 5)], R2: [("x", "Healthy"), ("y", "Healthy")]}
    )
    the_pod = pod(
        "p",
        ctr("app1", {R1: 1, R2: 1}),
        ctr("app2", {R1: 1, R2: 1}),
        init=[ctr("init1", {R1: 1}, init=True), ctr("init2", {R1: 2}, init=True)],
    )
    drive(alloc, the_pod)

    def held(name: str) -> frozenset[str]:
        devices = alloc.pod_devices.container_devices("p", name, R1)
        assert devices is not None
        return devices

    assert len(held("init1")) == 1 and len(held("init2")) == 2
    assert len(held("app1")) == 1 and len(held("app2")) == 1
    assert held("init1") <= held("init2")
    assert held("app1") <= held("init2") and held("app2") <= held("init2")
    assert not held("app1") & held("app2")
    assert alloc.pod_devices.allocated_count(R1) == 2  # nothing beyond the init container's two


def test_restartable_init_containers_keep_their_devices() -> None:
    """TestRestartableInitContainerDeviceAllocation (§6.1 item 16)."""
    alloc = allocator_with({R1: [(f"dev{i}", "Healthy") for i in range(1, 7)]})
    the_pod = pod(
        "p",
        ctr("app1", {R1: 1}),
        ctr("app2", {R1: 2}),
        init=[
            ctr("regular", {R1: 3}, init=True),
            ctr("sidecar1", {R1: 1}, init=True, restartable=True),
            ctr("sidecar2", {R1: 2}, init=True, restartable=True),
        ],
    )
    drive(alloc, the_pod)
    held = {
        c: alloc.pod_devices.container_devices("p", c, R1) or frozenset()
        for c in ["regular", "sidecar1", "sidecar2", "app1", "app2"]
    }
    assert held["sidecar1"] | held["sidecar2"] <= held["regular"]
    dedicated = ["sidecar1", "sidecar2", "app1", "app2"]
    for i, a in enumerate(dedicated):
        assert len(held[a]) == {"sidecar1": 1, "sidecar2": 2, "app1": 1, "app2": 2}[a]
        for b in dedicated[i + 1 :]:
            assert not held[a] & held[b], (a, b)


def test_preferred_allocation_is_asked_and_followed() -> None:
    alloc = allocator_with(
        {R1: [(f"d{i}", "Healthy") for i in range(8)]}, PluginOptions(get_preferred_allocation_available=True)
    )
    log: list[object] = []
    drive(alloc, pod("p", ctr("c", {R1: 2})), preferred=lambda call: ["d6", "d3"], log=log)
    asked = [s for s in log if isinstance(s, PreferredCall)]
    assert len(asked) == 1
    assert asked[0].request == AskPreferred(tuple(f"d{i}" for i in range(8)), (), 2)
    assert alloc.pod_devices.container_devices("p", "c", R1) == {"d3", "d6"}


def test_no_preferred_allocation_asked_when_the_aligned_devices_complete_the_request() -> None:
    """Upstream devicesToAllocate (v1.36 manager.go) returns as soon as `take(aligned)` completes the request, before
    callGetPreferredAllocationIfAvailable: one device per NUMA node and a request of 1 is the common case. The plugin
    must get no RPC the kubelet never sends (a failing one would fail the admission)."""
    numa_per_device = {R1: [("d0", "Healthy", (0,)), ("d1", "Healthy", (1,))]}
    alloc = allocator_with(numa_per_device, PluginOptions(get_preferred_allocation_available=True))
    assert alloc.devices_to_allocate("p", "c", R1, 1, affinity=mask_of([0])) == Chosen(("d0",))

    alloc = allocator_with(numa_per_device, PluginOptions(get_preferred_allocation_available=True))
    log: list[object] = []
    drive(alloc, pod("p", ctr("c", {R1: 1})), policy="best-effort", numa=(0, 1), log=log)
    assert [step for step in log if isinstance(step, PreferredCall)] == []
    assert alloc.pod_devices.container_devices("p", "c", R1) == {"d0"}

    # Two wanted, one aligned: the plugin is still asked for the rest, as upstream.
    alloc = allocator_with(numa_per_device, PluginOptions(get_preferred_allocation_available=True))
    assert alloc.devices_to_allocate("p", "c", R1, 2, affinity=mask_of([0])) == AskPreferred(("d0", "d1"), ("d0",), 2)


def test_preferred_answer_rechecked_after_the_await() -> None:
    """While GetPreferredAllocation is in flight another admission takes the preferred device: it is not given
    twice (the race of kubernetes#137534), and bogus IDs in the answer are ignored."""
    alloc = allocator_with(
        {R1: [(f"d{i}", "Healthy") for i in range(3)]}, PluginOptions(get_preferred_allocation_available=True)
    )
    first = admit_pod(alloc, pod("p1", ctr("c", {R1: 1})))
    step = next(first)
    assert isinstance(step, PreferredCall)
    # a second pod, admitted entirely while the first waits for its answer, gets d0 (its own preference)
    drive(alloc, pod("p2", ctr("c", {R1: 1})), preferred=lambda call: ["d0"])
    step = first.send({"d0", "bogus"})
    assert isinstance(step, AllocateCall)
    assert step.devices == ("d1",)
    with pytest.raises(StopIteration):
        first.send(pb.ContainerAllocateResponse())
    assert alloc.pod_devices.holders(R1, "d0") == {("p2", "c")}


def test_reservation_blocks_concurrent_admission_and_failure_releases() -> None:
    alloc = allocator_with({R1: [("d0", "Healthy")]})
    first = admit_pod(alloc, pod("p1", ctr("c", {R1: 1})))
    step = next(first)
    assert isinstance(step, AllocateCall) and step.devices == ("d0",)
    with pytest.raises(AllocationError, match="Available: 0"):
        drive(alloc, pod("p2", ctr("c", {R1: 1})))
    # the first admission's Allocate RPC fails: its reservation goes, the device can be given again
    first.close()
    alloc.release_pod("p1")
    drive(alloc, pod("p3", ctr("c", {R1: 1})))
    assert alloc.pod_devices.holders(R1, "d0") == {("p3", "c")}


def test_failed_admission_releases_earlier_containers() -> None:
    alloc = allocator_with({R1: [("a", "Healthy"), ("b", "Healthy")], R2: [("x", "Healthy")]})

    def fail_on_r2(call: AllocateCall) -> pb.ContainerAllocateResponse:
        if call.resource == R2:
            raise RuntimeError("plugin said no")
        return pb.ContainerAllocateResponse()

    with pytest.raises(RuntimeError):
        drive(alloc, pod("p", ctr("c1", {R1: 2}), ctr("c2", {R2: 1})), allocate=fail_on_r2)
    assert not alloc.pod_devices.has_pod("p")
    assert alloc.allocated(R1) == set() and alloc.allocated(R2) == set()


def test_restored_pod_is_admitted_without_rpcs() -> None:
    alloc = allocator_with({R1: [("a", "Healthy"), ("b", "Healthy")]})
    the_pod = pod("p", ctr("c", {R1: 1}))
    drive(alloc, the_pod)
    log: list[object] = []
    outcome = drive(alloc, the_pod, log=log)
    assert outcome.restored and log == []


def test_zero_request_skips_allocate_but_still_checks_health() -> None:
    alloc = allocator_with({R1: [("a", "Unhealthy")]})
    with pytest.raises(AllocationError, match="no healthy devices present"):
        drive(alloc, pod("p", ctr("c", {R1: 0})))
    alloc = allocator_with({R1: [("a", "Healthy")]})
    log: list[object] = []
    drive(alloc, pod("p", ctr("c", {R1: 0})), log=log)
    assert log == []


def test_a_zero_limit_still_gives_topology_hints() -> None:
    """Upstream getContainerDeviceRequest keeps a zero limit, and generateDeviceTopologyHints(request=0) returns every
    mask with the single-node ones preferred: {0} and {1} preferred, {0,1} not. R2's three devices need both nodes
    (its only hint, {0,1}, preferred). Alone, R2 is admitted under restricted; beside R1's zero request no merged hint
    is preferred ({0} and {0,1} differ, and R1's {0,1} is not preferred), so restricted refuses the container, and
    best-effort allocates across both nodes, where the plugin's choice stands."""
    devices = {
        R1: [("x0", "Healthy", (0,)), ("x1", "Healthy", (1,))],
        R2: [("a0", "Healthy", (0,)), ("a1", "Healthy", (0,)), ("b0", "Healthy", (1,)), ("b1", "Healthy", (1,))],
    }
    alloc = allocator_with(devices, PluginOptions(get_preferred_allocation_available=True))
    prefer = {"b0", "b1", "a0"}
    drive(alloc, pod("alone", ctr("c", {R2: 3})), policy="restricted", numa=(0, 1), preferred=lambda call: prefer)
    assert alloc.pod_devices.container_devices("alone", "c", R2) == prefer
    alloc.release_pod("alone")
    with pytest.raises(AllocationError) as err:
        drive(alloc, pod("q", ctr("c", {R1: 0, R2: 3})), policy="restricted", numa=(0, 1))
    assert err.value.kind == "topology" and "TopologyAffinityError" in str(err.value)
    drive(alloc, pod("p", ctr("c", {R1: 0, R2: 3})), policy="best-effort", numa=(0, 1), preferred=lambda call: prefer)
    assert alloc.pod_devices.container_devices("p", "c", R2) == prefer
    assert alloc.pod_devices.container_devices("p", "c", R1) is None


def test_resources_no_plugin_serves_are_refused_without_any_rpc() -> None:
    alloc = allocator_with({R1: [("a", "Healthy")]})
    log: list[object] = []
    with pytest.raises(AllocationError, match=r"^cannot allocate unregistered device other\.com/thing$"):
        drive(alloc, pod("p", ctr("c", {R1: 1, "other.com/thing": 1})), log=log)
    assert log == [] and alloc.allocated(R1) == set()
    drive(alloc, pod("q", ctr("c", {R1: 1, "other.com/thing": 0})))  # a zero request asks for nothing


def test_numa_aligned_allocation_with_restricted_policy() -> None:
    devices = [(f"n0-{i}", "Healthy", (0,)) for i in range(2)] + [(f"n1-{i}", "Healthy", (1,)) for i in range(2)]
    alloc = allocator_with({R1: devices})
    alloc.pod_devices.insert(make_allocation("x", "c", R1, {0: ("n0-0",)}, pb.ContainerAllocateResponse()))
    # 2 devices: only NUMA 1 still has two free -> aligned there
    drive(alloc, pod("p", ctr("c", {R1: 2})), policy="restricted", numa=[0, 1])
    assert alloc.pod_devices.container_devices("p", "c", R1) == {"n1-0", "n1-1"}
    entry = alloc.pod_devices.container_allocations("p", "c")[R1]
    assert entry.per_numa == {1: ("n1-0", "n1-1")}
    # one device free on each node: a 2-device pod can only be spread -> single-numa-node refuses it, saying why
    alloc.release_pod("p")
    alloc.pod_devices.insert(make_allocation("y", "c", R1, {1: ("n1-0",)}, pb.ContainerAllocateResponse()))
    with pytest.raises(AllocationError) as err:
        drive(alloc, pod("q", ctr("big", {R1: 2})), policy="single-numa-node", numa=[0, 1])
    assert "TopologyAffinityError" in str(err.value) and "single-numa-node" in str(err.value)
    assert err.value.kind == "topology"
    assert not alloc.pod_devices.has_pod("q")
    drive(alloc, pod("q", ctr("big", {R1: 2})), policy="best-effort", numa=[0, 1])
    assert alloc.pod_devices.container_devices("q", "big", R1) == {"n0-1", "n1-1"}


def test_best_effort_spreads_when_it_must() -> None:
    devices = [("a", "Healthy", (0,)), ("b", "Healthy", (1,))]
    alloc = allocator_with({R1: devices})
    drive(alloc, pod("p", ctr("c", {R1: 2})), policy="best-effort", numa=[0, 1])
    assert alloc.pod_devices.container_devices("p", "c", R1) == {"a", "b"}


def test_pre_start_calls_only_where_asked() -> None:
    """TestDevicePreStartContainer (§6.1 item 18): both devices; a zero request triggers nothing."""
    alloc = allocator_with({R1: [("dev1", "Healthy"), ("dev2", "Healthy")]}, PluginOptions(pre_start_required=True))
    the_pod = pod("p", ctr("c", {R1: 2}), ctr("zero", {R1: 0}))
    drive(alloc, the_pod)
    calls = pre_start_calls(alloc, the_pod)
    assert [(c.container, c.resource, c.devices) for c in calls] == [("c", R1, ("dev1", "dev2"))]


def test_devices_per_numa_books_multi_node_and_no_topology() -> None:
    known = {"a": Device("a", "Healthy", (0, 1)), "b": Device("b", "Healthy")}
    assert devices_per_numa(["a", "b"], known) == {-1: ("b",), 0: ("a",), 1: ("a",)}


def test_natural_order() -> None:
    assert natural_sorted(["sim-10", "sim-2", "sim-1"]) == ["sim-1", "sim-2", "sim-10"]


def test_pod_devices_refcounts_shared_init_devices() -> None:
    pds = PodDevices()
    pds.insert(make_allocation("p", "init", R1, {-1: ("a", "b")}, pb.ContainerAllocateResponse()))
    pds.insert(make_allocation("p", "app", R1, {-1: ("a",)}, pb.ContainerAllocateResponse()))
    assert pds.allocated(R1) == {"a", "b"}
    assert pds.holders(R1, "a") == {("p", "init"), ("p", "app")}
    pds.remove_pod("p")
    assert pds.allocated(R1) == set() and len(pds) == 0


def test_device_choice_follows_health_changes_and_new_ids_after_the_first_admission() -> None:
    """The allocator keeps a resource's device order while a snapshot keeps its IDs (a health change) and updates its
    free-device index in place; a snapshot with other IDs, even as many, gets a new order."""
    alloc = allocator_with({R1: [("dev-1", "Healthy"), ("dev-2", "Healthy"), ("dev-10", "Healthy")]})
    sock = "/tmp/domain1.com_resource1.sock"

    def chosen(uid: str) -> frozenset[str] | None:
        drive(alloc, pod(uid, ctr("c", {R1: 1})))
        return alloc.held(uid, "c", R1)

    assert chosen("first") == {"dev-1"}
    alloc.registry.apply_snapshot(R1, sock, [Device("dev-1", "Healthy"), Device("dev-2", "Unhealthy"),
                                             Device("dev-10", "Healthy")])  # fmt: skip
    assert chosen("skips-unhealthy") == {"dev-10"}
    alloc.release_pod("first")
    alloc.registry.apply_snapshot(R1, sock, [Device(d, "Healthy") for d in ("dev-1", "dev-2", "dev-10")])
    assert chosen("healthy-again") == {"dev-1"} and chosen("next") == {"dev-2"}
    alloc.registry.apply_snapshot(R1, sock, [Device(d, "Healthy") for d in ("gpu-3", "gpu-1", "gpu-2")])
    assert chosen("new-ids") == {"gpu-1"} and chosen("new-ids-2") == {"gpu-2"}
