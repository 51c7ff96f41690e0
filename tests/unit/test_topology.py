"""Device topology hints (spec §4.12 examples) and the topology manager's merge per policy."""

from __future__ import annotations

from deviceplane.core.registry import Device
from deviceplane.core.topology import (
    Admission,
    ResourceDevices,
    TopologyHint,
    _best_non_preferred_count,
    _compare,
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


# -- the topology manager's merge, mirrored from upstream policy_test.go -----------------------------------------------

NUMA4 = [0, 1, 2, 3]
F, T = False, True


def test_compare_hints_narrowest_upstream_cases() -> None:
    """Upstream TestCompareHintsNarrowest: which of (current, candidate) HintMerger.compare keeps, by its cases."""
    cases = [  # (description, bestNonPreferredAffinityCount, current, candidate, expected)
        ("candidate.NUMANodeAffinity.Count() == 0 (1)", -1, None, TopologyHint(0, F), "current"),
        ("candidate.NUMANodeAffinity.Count() == 0 (2)", -1, TopologyHint(0, T), TopologyHint(0, F), "current"),
        ("current == nil (1)", -1, None, h([0], T), "candidate"),
        ("current == nil (2)", -1, None, h([0], F), "candidate"),
        ("!current.Preferred && candidate.Preferred", -1, h([0], F), h([0], T), "candidate"),
        ("current.Preferred && !candidate.Preferred", -1, h([0], T), h([0], F), "current"),
        ("current.Preferred && candidate.Preferred (1)", -1, h([0], T), h([0], T), "current"),
        ("current.Preferred && candidate.Preferred (2)", -1, h([0, 1], T), h([0], T), "candidate"),
        ("current.Preferred && candidate.Preferred (3)", -1, h([0], T), h([0, 1], T), "current"),
        ("!current.Preferred && !candidate.Preferred (1.1)", 1, h([0, 1], F), h([0, 1], F), "current"),
        ("!current.Preferred && !candidate.Preferred (1.2)", 1, h([1, 2], F), h([0, 1], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (1.3)", 1, h([0, 1], F), h([1, 2], F), "current"),
        ("!current.Preferred && !candidate.Preferred (2.1)", 2, h([0, 1], F), h([0], F), "current"),
        ("!current.Preferred && !candidate.Preferred (2.2)", 2, h([0, 1], F), h([0, 1], F), "current"),
        ("!current.Preferred && !candidate.Preferred (2.3)", 2, h([1, 2], F), h([0, 1], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (2.4)", 2, h([0, 1], F), h([1, 2], F), "current"),
        ("!current.Preferred && !candidate.Preferred (3a)", 2, h([0], F), h([0, 1, 2], F), "current"),
        ("!current.Preferred && !candidate.Preferred (3b)", 2, h([0], F), h([0, 1], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (3ca.1)", 3, h([0], F), h([0, 1], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (3ca.2)", 3, h([0], F), h([1, 2], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (3ca.3)", 4, h([0, 1], F), h([1, 2, 3], F), "candidate"),
        ("!current.Preferred && !candidate.Preferred (3cb)", 4, h([1, 2, 3], F), h([0, 1], F), "current"),
        ("!current.Preferred && !candidate.Preferred (3cc.1)", 4, h([0, 1, 2], F), h([0, 1, 2], F), "current"),
        ("!current.Preferred && !candidate.Preferred (3cc.2)", 4, h([0, 1, 2], F), h([1, 2, 3], F), "current"),
        ("!current.Preferred && !candidate.Preferred (3cc.3)", 4, h([1, 2, 3], F), h([0, 1, 2], F), "candidate"),
    ]
    for description, best_count, current, candidate, expected in cases:
        kept = _compare(best_count, current, candidate)
        # identity, as upstream compares pointers: equal hints must still be told apart
        assert kept is (current if expected == "current" else candidate), description


def test_max_of_min_affinity_counts_upstream_cases() -> None:
    """Upstream TestMaxOfMinAffinityCounts, and what filterProvidersHints adds: a resource with no affinity at all (no
    topology, or nothing fits) has no narrowest hint and does not count."""
    cases = [
        ([], 0),
        ([[TopologyHint(0, T)]], 0),
        ([[h([0], T)]], 1),
        ([[h([0, 1], T)]], 2),
        ([[h([0, 1], T), h([0, 1, 2], T)]], 2),
        ([[h([0, 1], T), h([0, 1, 2], T)], [h([0, 1, 2], T)]], 3),
        ([[h([0, 1], T), h([0, 1, 2], T)], [h([0, 1, 2], T), h([0, 1, 2, 3], T)]], 3),
        ([[TopologyHint(None, T)], [h([0], F)]], 1),
        ([[TopologyHint(None, F)], [h([0, 1], F)]], 2),
    ]
    for hint_lists, expected in cases:
        assert _best_non_preferred_count(hint_lists) == expected, hint_lists


def test_merge_upstream_cases() -> None:
    """Upstream's policy merge cases where the rules differ from a plain AND of preferences: a merged hint is
    preferred only if every hint with an affinity has the same one; among non-preferred hints the one closest to the
    widest minimum wins, the lower-numbered mask on a tie (best-effort; restricted refuses what is not preferred)."""
    cases = [  # (upstream name, numa, hints per resource, expected merged hint)
        ("Two providers, 1 hint each, same mask, 1 preferred, 1 not 2/2", NUMA2,
         {"r1": [h([1], T)], "r2": [h([1], F)]}, h([1], F)),
        ("Two providers, 1 hint each, 1 wider mask, both preferred 1/2", NUMA2,
         {"r1": [h([0], T)], "r2": [h([0, 1], T)]}, h([0], F)),
        ("Two providers, 1 hint each, 1 wider mask, both preferred 2/2", NUMA2,
         {"r1": [h([1], T)], "r2": [h([0, 1], T)]}, h([1], F)),
        ("bestNonPreferredAffinityCount (1)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([0, 1], F)]}, h([0, 1], F)),
        ("bestNonPreferredAffinityCount (2)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([0, 3], F)]}, h([0, 3], F)),
        ("bestNonPreferredAffinityCount (3)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([1, 2], F)]}, h([1, 2], F)),
        ("bestNonPreferredAffinityCount (4)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([2, 3], F)]}, h([2, 3], F)),
        ("bestNonPreferredAffinityCount (5)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([1, 2], F), h([2, 3], F)]}, h([1, 2], F)),
        ("bestNonPreferredAffinityCount (6)", NUMA4,
         {"r1": [h([0, 1, 2, 3], F), h([0, 1], F)], "r2": [h([1, 2, 3], F), h([1, 2], F), h([1, 3], F), h([2, 3], F)]},
         h([1, 2], F)),
        ("One no-preference provider", NUMA2,
         {"r1": [h([0], T), h([1], T), h([0, 1], F)], "r2": None}, h([0], T)),
    ]  # fmt: skip
    for name, numa, hint_lists, expected in cases:
        decision = merge_hints("best-effort", numa, hint_lists)
        assert decision == Admission(expected, True), name
        assert merge_hints("restricted", numa, hint_lists) == Admission(expected, expected.preferred), name


def test_a_resource_without_topology_does_not_widen_the_choice() -> None:
    """Found by probing the agent (best-effort, 3 NUMA nodes, a pod asking for a topology-less resource and 2 GPUs
    that only fit across two nodes): the resource without topology counted as needing every node, so the merge chose
    all three nodes and gave the pod GPUs on nodes 1 and 2 where the kubelet chooses nodes 0 and 1."""
    gpu = [h([0, 1], F), h([0, 2], F), h([1, 2], F), h([0, 1, 2], F)]
    for other in (None, []):
        decision = merge_hints("best-effort", [0, 1, 2], {"notopo": other, "gpu": gpu})
        assert decision.hint == h([0, 1], F), other


def test_restricted_refuses_a_node_hint_merged_with_a_wider_one() -> None:
    """Found by probing the agent: r1 fits one device on either node, r2 needs both nodes' devices. The AND of {0}
    and {0,1} fits node 0, but upstream does not call it preferred (the masks differ), so restricted refuses the
    container where deviceplane used to admit it."""
    hint_lists = {"r1": [h([0], T), h([1], T), h([0, 1], F)], "r2": [h([0, 1], T)]}
    assert not merge_hints("restricted", NUMA2, hint_lists).admit
    assert merge_hints("best-effort", NUMA2, hint_lists) == Admission(h([0, 1], F), True)
