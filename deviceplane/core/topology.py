"""NUMA topology: the device manager's hints (spec §4.12) and the topology manager's merge per policy.

A NUMA affinity is an int bitmask (bit n = node n), as upstream's `bitmask.BitMask`; None means "no preference".
Only the device manager provides hints here (there is no CPU or memory manager), per container (container scope).
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deviceplane.core.registry import Device

POLICY_NONE = "none"
POLICY_BEST_EFFORT = "best-effort"
POLICY_RESTRICTED = "restricted"
POLICY_SINGLE_NUMA_NODE = "single-numa-node"
POLICIES = (POLICY_NONE, POLICY_BEST_EFFORT, POLICY_RESTRICTED, POLICY_SINGLE_NUMA_NODE)

# Upstream's pod status reason and message for a topology admission failure.
TOPOLOGY_AFFINITY_ERROR = "TopologyAffinityError"
TOPOLOGY_AFFINITY_MESSAGE = "Resources cannot be allocated with Topology locality"


# Upstream's bitmask.BitMask is a uint64: NewBitMask refuses node ids >= 64 and IsSet reads them as unset.
MAX_NUMA_NODES = 64


# Upstream refuses to create a topology manager other than "none" for more NUMA nodes than this (its hint merge is
# exponential in the node count); the kubelet's policy option max-allowable-numa-nodes raises it, we keep the default.
MAX_ALLOWABLE_NUMA_NODES = 8


def numa_nodes_problem(policy: str, node_count: int) -> str | None:
    """Upstream NewManager's refusal of a machine with too many NUMA nodes for a topology policy, or None."""
    if policy != POLICY_NONE and node_count > MAX_ALLOWABLE_NUMA_NODES:
        return f"unsupported on machines with more than {MAX_ALLOWABLE_NUMA_NODES} NUMA Nodes"
    return None


def mask_of(nodes: Iterable[int]) -> int:
    mask = 0
    for node in nodes:
        if 0 <= node < MAX_NUMA_NODES:  # bounded: `1 << 2**62` would exhaust memory
            mask |= 1 << node
    return mask


def nodes_of(mask: int) -> list[int]:
    return [bit for bit in range(mask.bit_length()) if mask >> bit & 1]


def _count(mask: int) -> int:
    return bin(mask).count("1")


def _narrower(a: int, b: int) -> bool:
    """Upstream IsNarrowerThan: fewer nodes, or as many and a smaller mask value (lower-numbered nodes)."""
    return _count(a) < _count(b) or (_count(a) == _count(b) and a < b)


_numa_nodes = operator.attrgetter("numa_nodes")


def has_topology(devices: Mapping[str, Device]) -> bool:
    """Upstream deviceHasTopologyAlignment: whether any device of the resource reports NUMA nodes."""
    return any(map(_numa_nodes, devices.values()))


@dataclass(frozen=True, slots=True)
class TopologyHint:
    affinity: int | None  # None: any NUMA node will do
    preferred: bool

    def describe(self) -> str:
        nodes = "any" if self.affinity is None else ",".join(map(str, nodes_of(self.affinity)))
        return f"{{nodes: {nodes}, preferred: {str(self.preferred).lower()}}}"


@dataclass(frozen=True, slots=True)
class ResourceDevices:
    """What hint generation needs to know about one resource."""

    all_devices: Mapping[str, Device]
    healthy: Collection[str]
    allocated: Collection[str]  # held by any pod, or reserved by an admission in flight

    def has_topology(self) -> bool:
        return has_topology(self.all_devices)

    def available(self) -> set[str]:
        return {d for d in self.healthy if d not in self.allocated}


def device_hints(
    resource: ResourceDevices, available: Collection[str], reusable: Collection[str], request: int, numa: Sequence[int]
) -> list[TopologyHint]:
    """Upstream generateDeviceTopologyHints (spec §4.12)."""
    device_masks = {device_id: mask_of(device.numa_nodes) for device_id, device in resource.all_devices.items()}
    # Devices grouped by their NUMA mask: a node has few distinct masks, so each candidate affinity is cheap to test.
    all_by_mask = Counter(device_masks.values())
    available_by_mask = Counter(device_masks.get(d, 0) for d in available)
    reusable_masks = [device_masks.get(d, 0) for d in reusable]
    reusable_with_topology = sum(1 for m in reusable_masks if m)
    min_affinity = len(numa)
    found: list[int] = []
    for size in range(1, len(numa) + 1):
        for combination in itertools.combinations(numa, size):
            mask = mask_of(combination)
            # Every device, whatever its health or holder, counts for the narrowest possible affinity.
            in_mask = sum(n for m, n in all_by_mask.items() if m & mask)
            if in_mask >= request and size < min_affinity:
                min_affinity = size
            # A reusable device with topology must lie (at least partly) inside the affinity.
            if any(m and not m & mask for m in reusable_masks):
                continue
            matching = reusable_with_topology + sum(n for m, n in available_by_mask.items() if m & mask)
            if matching >= request:
                found.append(mask)
    return [TopologyHint(mask, _count(mask) == min_affinity) for mask in found]


def resource_hints(
    resource: ResourceDevices,
    request: int,
    already: Collection[str] | None,
    reusable: Collection[str],
    numa: Sequence[int],
) -> list[TopologyHint] | None:
    """Upstream GetTopologyHints for one resource of one container: None = no preference, [] = cannot satisfy."""
    if not resource.has_topology():
        return None
    if already:
        if len(already) != request:
            return []
        return device_hints(resource, already, (), request, numa)
    available = resource.available()
    if len(available | set(reusable)) < request:
        return []
    return device_hints(resource, available, reusable, request, numa)


def _filter_provider_hints(hints: Mapping[str, list[TopologyHint] | None]) -> list[list[TopologyHint]]:
    """Upstream filterProvidersHints: no preference -> [{nil, true}]; cannot satisfy -> [{nil, false}]."""
    out = []
    for resource_list in hints.values():
        if resource_list is None:
            out.append([TopologyHint(None, True)])
        elif not resource_list:
            out.append([TopologyHint(None, False)])
        else:
            out.append(list(resource_list))
    return out or [[TopologyHint(None, True)]]


def _best_non_preferred_count(hints: list[list[TopologyHint]]) -> int:
    """Upstream maxOfMinAffinityCounts: the widest of the resources' narrowest affinities. A resource without any
    affinity (no topology, or nothing that fits) has no narrowest and does not count."""
    best = 0
    for resource_list in hints:
        counts = [_count(hint.affinity) for hint in resource_list if hint.affinity is not None]
        if counts:
            best = max(best, min(counts))
    return best


def _fitter(current: TopologyHint, candidate: TopologyHint) -> TopologyHint:
    """Upstream's mask comparison (Narrowest): the candidate only if strictly narrower, so a tie keeps `current`."""
    assert current.affinity is not None and candidate.affinity is not None
    return candidate if _narrower(candidate.affinity, current.affinity) else current


def _compare(best_count: int, current: TopologyHint | None, candidate: TopologyHint) -> TopologyHint | None:
    """Upstream HintMerger.compare (its case numbers below)."""
    assert candidate.affinity is not None
    if _count(candidate.affinity) == 0:
        return current
    if current is None:
        return candidate
    assert current.affinity is not None
    if current.preferred != candidate.preferred:
        return candidate if candidate.preferred else current
    if current.preferred:
        return _fitter(current, candidate)
    # Both non-preferred: the mask whose size is closest to (not above) the widest minimum any resource needs.
    cur, cand = _count(current.affinity), _count(candidate.affinity)
    if cur > best_count:  # 1: anything fitter brings it down
        return _fitter(current, candidate)
    if cur == best_count:  # 2: stay, unless the candidate is as wide and fitter
        return _fitter(current, candidate) if cand == best_count else current
    if cand > best_count:  # 3a
        return current
    if cand == best_count:  # 3b
        return candidate
    if cand != cur:  # 3ca, 3cb: the wider of two below the count
        return candidate if cand > cur else current
    return _fitter(current, candidate)  # 3cc


def _merge_permutation(default: int, permutation: Iterable[TopologyHint]) -> TopologyHint:
    """Upstream mergePermutation: the affinities ANDed; preferred only if every hint is, and every hint that has an
    affinity has the same one (a node-0 hint merged with a nodes-0-and-1 hint fits node 0, but not as preferred)."""
    affinity = default
    preferred = True
    first: int | None = None
    for hint in permutation:
        if hint.affinity is not None:
            if first is None:
                first = hint.affinity
            elif hint.affinity != first:
                preferred = False
            affinity &= hint.affinity
        if not hint.preferred:
            preferred = False
    return TopologyHint(affinity, preferred)


def _merge(hints: list[list[TopologyHint]], numa: Sequence[int]) -> TopologyHint:
    default = mask_of(numa)
    best_count = _best_non_preferred_count(hints)
    best: TopologyHint | None = None
    for permutation in itertools.product(*hints):
        best = _compare(best_count, best, _merge_permutation(default, permutation))
    return best if best is not None else TopologyHint(default, False)


@dataclass(frozen=True, slots=True)
class Admission:
    hint: TopologyHint
    admit: bool


def merge_hints(policy: str, numa: Sequence[int], hints: Mapping[str, list[TopologyHint] | None]) -> Admission:
    """The topology manager's policy for one container: the NUMA affinity to allocate with, and whether it may be
    admitted at all (restricted and single-numa-node refuse when no preferred hint fits)."""
    if policy == POLICY_NONE or not numa:
        return Admission(TopologyHint(None, True), True)
    filtered = _filter_provider_hints(hints)
    if policy == POLICY_SINGLE_NUMA_NODE:
        filtered = [
            [h for h in hs if h.preferred and (h.affinity is None or _count(h.affinity) == 1)] for hs in filtered
        ]
        best = _merge(filtered, numa)
        if best.affinity == mask_of(numa):
            best = TopologyHint(None, best.preferred)
        return Admission(best, best.preferred)
    best = _merge(filtered, numa)
    if policy == POLICY_RESTRICTED:
        return Admission(best, best.preferred)
    return Admission(best, True)


def rejection_reason(policy: str, container: str, hints: Mapping[str, list[TopologyHint] | None]) -> str:
    shown = "; ".join(
        f"{resource}: " + ("no preference" if hs is None else "[" + ", ".join(h.describe() for h in hs) + "]")
        for resource, hs in hints.items()
    )
    return (
        f"{TOPOLOGY_AFFINITY_ERROR}: {TOPOLOGY_AFFINITY_MESSAGE}: topology policy {policy} found no preferred "
        f"NUMA affinity for container {container!r} (hints: {shown})"
    )
