"""Device topology hints (spec §4.12 examples) and the topology manager's merge per policy."""

from __future__ import annotations

from deviceplane.core.registry import Device
from deviceplane.core.topology import (
    ResourceDevices,
    TopologyHint,
    mask_of,
    merge_hints,
    resource_hints,
)

NUMA2 = [0, 1]


def resource(devices: list[Device], allocated: set[str] | None = None) -> ResourceDevices:
    return ResourceDevices({d.id: d for d in devices}, {d.id for d in devices if d.is_healthy}, allocated or set())


def hints(res: ResourceDevices, request: int, reusable: set[str] | None = None) -> list[TopologyHint] | None:
    return resource_hints(res, request, None, reusable or set(), NUMA2)


def as_pairs(found: list[TopologyHint] | None) -> list[tuple[tuple[int, ...], bool]] | None:
    if found is None:
        return None
    return sorted(
        (tuple(n for n in range(4) if h.affinity is not None and h.affinity >> n & 1), h.preferred) for h in found
    )


def test_one_without_topology_one_on_node1() -> None:
    res = resource([Device("Dev1", "Healthy"), Device("Dev2", "Healthy", (1,))])
    assert as_pairs(hints(res, 1)) == [((0, 1), False), ((1,), True)]


def test_one_device_per_node_request_two() -> None:
    res = resource([Device("Dev1", "Healthy", (0,)), Device("Dev2", "Healthy", (1,))])
    assert as_pairs(hints(res, 2)) == [((0, 1), True)]


def test_min_affinity_counts_allocated_devices_too() -> None:
    res = resource(
        [Device(f"Dev{i}", "Healthy", (0 if i <= 2 else 1,)) for i in range(1, 5)], allocated={"Dev1", "Dev2"}
    )
    assert as_pairs(hints(res, 2)) == [((0, 1), False), ((1,), True)]
    res = resource(
        [Device(f"Dev{i}", "Healthy", (0 if i in (1, 3) else 1,)) for i in range(1, 5)], allocated={"Dev1", "Dev2"}
    )
    # one free device per node: only both nodes together fit, and that is not the narrowest possible
    assert as_pairs(hints(res, 2)) == [((0, 1), False)]


def test_request_beyond_devices_cannot_be_satisfied() -> None:
    res = resource([Device(f"Dev{i}", "Healthy", (i % 2,)) for i in range(4)])
    assert hints(res, 6) == []


def test_no_topology_means_no_preference() -> None:
    assert hints(resource([Device("a", "Healthy")]), 1) is None


def test_reusable_device_outside_mask_drops_it() -> None:
    res = resource([Device("a", "Healthy", (0,)), Device("b", "Healthy", (1,))], allocated={"a"})
    assert as_pairs(hints(res, 1, reusable={"a"})) == [((0,), True), ((0, 1), False)]


def test_already_allocated_regenerates_or_fails() -> None:
    res = resource([Device("a", "Healthy", (1,)), Device("b", "Healthy", (0,))], allocated={"a"})
    assert as_pairs(resource_hints(res, 1, {"a"}, set(), NUMA2)) == [((0, 1), False), ((1,), True)]
    assert resource_hints(res, 2, {"a"}, set(), NUMA2) == []


def h(nodes: list[int] | None, preferred: bool) -> TopologyHint:
    return TopologyHint(None if nodes is None else mask_of(nodes), preferred)


def test_policy_none_admits_without_affinity() -> None:
    decision = merge_hints("none", NUMA2, {"r": []})
    assert decision.admit and decision.hint.affinity is None


def test_best_effort_picks_narrowest_preferred_and_always_admits() -> None:
    decision = merge_hints("best-effort", NUMA2, {"r": [h([0], True), h([1], True), h([0, 1], False)]})
    assert decision == type(decision)(h([0], True), True)
    spread = merge_hints("best-effort", NUMA2, {"r": [h([0, 1], False)]})
    assert spread.admit and spread.hint == h([0, 1], False)


def test_restricted_rejects_without_preferred_hint() -> None:
    assert not merge_hints("restricted", NUMA2, {"r": [h([0, 1], False)]}).admit
    assert not merge_hints("restricted", NUMA2, {"r": []}).admit
    ok = merge_hints("restricted", NUMA2, {"r": [h([0, 1], True)]})
    assert ok.admit and ok.hint == h([0, 1], True)


def test_merging_two_resources_intersects() -> None:
    decision = merge_hints(
        "restricted",
        NUMA2,
        {"r1": [h([0], True), h([1], True), h([0, 1], False)], "r2": [h([1], True), h([0, 1], False)]},
    )
    assert decision.admit and decision.hint == h([1], True)
    # no single node satisfies both preferred: restricted refuses
    refused = merge_hints("restricted", NUMA2, {"r1": [h([0], True)], "r2": [h([1], True)]})
    assert not refused.admit


def test_single_numa_node() -> None:
    assert not merge_hints("single-numa-node", NUMA2, {"r": [h([0, 1], True)]}).admit
    ok = merge_hints("single-numa-node", NUMA2, {"r": [h([1], True), h([0, 1], False)]})
    assert ok.admit and ok.hint == h([1], True)
    # no preference at all: admitted with no affinity
    anywhere = merge_hints("single-numa-node", NUMA2, {"r": None})
    assert anywhere.admit and anywhere.hint.affinity is None
