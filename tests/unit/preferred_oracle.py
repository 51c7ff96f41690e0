"""pack_on_numa as it was first written (main at 07e9fcf, copied verbatim but for the name): it sorts each NUMA
node's every device and takes from the front - the "old" side of benchmarks/preferred.py - and the rule it follows
since it fills the must_include devices' nodes first and then picks the best-fitting node, written as plainly: the
oracle of tests/unit/test_plugin_preferred.py. Test code only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
from deviceplane.core.ordering import natural_key


def sorting_everything(
    available: Iterable[str], must_include: Sequence[str], size: int, numa_of: Mapping[str, Sequence[int]]
) -> list[str]:
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) >= size:
        return chosen
    taken = set(chosen)
    by_node: dict[int, list[str]] = {}
    for device_id in dict.fromkeys(available):
        if device_id not in taken:
            nodes = numa_of.get(device_id) or (NODE_WITHOUT_TOPOLOGY,)
            by_node.setdefault(min(nodes), []).append(device_id)
    for _, ids in sorted(by_node.items(), key=lambda item: (-len(item[1]), item[0])):
        for device_id in sorted(ids, key=natural_key):
            if len(chosen) == size:
                return chosen
            chosen.append(device_id)
    return chosen


def sorting_everything_best_fit(
    available: Iterable[str], must_include: Sequence[str], size: int, numa_of: Mapping[str, Sequence[int]]
) -> list[str]:
    """The rule pack_on_numa follows now, written plainly (every node's devices sorted, nodes picked by scanning):
    the must_include devices' nodes first (most of them first), then the node with the fewest free devices that
    holds the rest, else the one with the most, over again."""

    def node(device_id: str) -> int:
        return min(numa_of.get(device_id) or (NODE_WITHOUT_TOPOLOGY,))

    chosen = list(dict.fromkeys(must_include))
    free: dict[int, list[str]] = {}
    for device_id in dict.fromkeys(available):
        if device_id not in chosen:
            free.setdefault(node(device_id), []).append(device_id)
    for ids in free.values():
        ids.sort(key=natural_key)
    must_nodes = [node(d) for d in chosen if node(d) != NODE_WITHOUT_TOPOLOGY]
    order = sorted(set(must_nodes), key=lambda n: (-must_nodes.count(n), n))
    while len(chosen) < size and free:
        need = size - len(chosen)
        must_left = [n for n in order if n in free]
        if must_left:
            pick = must_left[0]
        elif any(len(ids) >= need for ids in free.values()):
            pick = min((n for n in free if len(free[n]) >= need), key=lambda n: (len(free[n]), n))
        else:
            pick = max(free, key=lambda n: (len(free[n]), -n))
        chosen.extend(free.pop(pick)[:need])
    return chosen
