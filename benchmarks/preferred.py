"""The SDK's NUMA-packing preferred allocation (deviceplane.plugin.preferred.pack_on_numa, the sim plugin's
GetPreferredAllocation): CPU µs per call, the first version that sorted each node's every device
(tests/unit/preferred_oracle.py: "old") against the current one ("new").

A call is what the kubelet (or the agent) asks for each container: every free ID of the resource, in plain order,
and a size; devices sim-0..N-1 laid out on 2 NUMA nodes in blocks, as the sim does. The figure is the median over
rounds of process time per call (the first round, which fills the key cache, is not counted).

    python benchmarks/preferred.py [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.plugin.preferred import NumaLayout, pack_on_numa  # noqa: E402
from deviceplane.plugin.sim import numa_layout  # noqa: E402
from tests.unit.preferred_oracle import sorting_everything  # noqa: E402

Pack = Callable[[list[str], list[str], int, Mapping[str, Sequence[int]] | NumaLayout], list[str]]


def measure(
    pack: Pack,
    available: list[str],
    size: int,
    numa: Mapping[str, Sequence[int]] | NumaLayout,
    rounds: int,
    calls: int,
) -> float:
    per_call = []
    for r in range(rounds + 1):
        started = time.process_time()
        for _ in range(calls):
            pack(available, [], size, numa)
        if r:
            per_call.append((time.process_time() - started) / calls * 1e6)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per round [200]")
    args = parser.parse_args()
    print(f"{'devices':>8} {'size':>5} {'old µs':>9} {'new µs':>9} {'layout µs':>10}  answers")
    differ = 0
    for devices in (1024, 10_000):
        numa = numa_layout(devices, 2)
        available = [f"sim-{i}" for i in range(devices)]
        for size in (1, 8):
            old = measure(sorting_everything, available, size, numa, args.rounds, args.calls)
            new = measure(pack_on_numa, available, size, numa, args.rounds, args.calls)
            layout = NumaLayout(numa)
            laid = measure(pack_on_numa, available, size, layout, args.rounds, args.calls)
            answer = sorting_everything(available, [], size, numa)
            same = pack_on_numa(available, [], size, numa) == answer == pack_on_numa(available, [], size, layout)
            differ += not same
            print(f"{devices:>8} {size:>5} {old:>9.0f} {new:>9.0f} {laid:>10.0f}  {'(same)' if same else 'DIFFER'}")
    if differ:
        sys.exit(f"{differ} answers differ from the first version's")


if __name__ == "__main__":
    main()
