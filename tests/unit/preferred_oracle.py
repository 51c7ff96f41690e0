"""pack_on_numa as it was first written (main at 07e9fcf, copied verbatim but for the name): it sorts each NUMA
node's every device and takes from the front. The oracle of tests/unit/test_plugin_preferred.py and the "old" side of
benchmarks/preferred.py. Test code only."""

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
