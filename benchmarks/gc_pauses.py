"""Garbage-collection pauses in the agent's admissions: CPython's own collector against the heap settles.

The agent runs as in compare.py (`--debug-admit-api`, 1,024-device sims, one answering Allocate only, one with
GetPreferredAllocation and PreStart, and a filler resource), once with `--gc-settle-interval 0` (CPython's collector
as it is) and once with the default settles (deviceplane/agent/heap.py), alternated run by run. Each run: the warm-up
and sustained batches of compare.py, then `--reps` rounds of the four 0-held cells (Allocate only / all RPCs,
sequential / 8 concurrent), each followed by `--idle` seconds without traffic (pods come in bursts), then `--held`
containers held and `--reps` rounds again. Printed per setting: the admissions slower than 10 ms in the 8-concurrent
Allocate-only cells (a pause holds every admission in flight), those cells' p99s, and from the agent's /metrics the
collections during the traffic: CPython's own by generation (`deviceplane_agent_gc_pause_seconds`) and the settles
(`deviceplane_agent_heap_settle_seconds`), each with the bucket bound that holds the longest.

    python benchmarks/gc_pauses.py [--runs 2] [--reps 3] [--pods 200] [--idle 0.5] [--held 5000] [--sustained 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import (  # noqa: E402
    AgentSide,
    http_get,
    percentile,
    rounds_of_cells,
    start_cell_sims,
    stop_procs,
    sustained,
    warm_up,
)

SETTINGS = {"CPython's collector": "0", "heap settles (default)": None}
SLOW_SECONDS = 0.010


class SettledAgentSide(AgentSide):
    def __init__(self, work: Path, settle_interval: str | None) -> None:
        super().__init__(work)
        self.settle_interval = settle_interval

    def argv(self) -> list[str]:
        extra = [] if self.settle_interval is None else ["--gc-settle-interval", self.settle_interval]
        return [*super().argv(), *extra]

    def pauses(self) -> dict[str, list[tuple[float, float]]]:
        """The agent's pause histograms, (bound, cumulative count) per series: "0", "1", "2" for CPython's own
        collections by generation (`deviceplane_agent_gc_pause_seconds`), "recent" and "full" for the settles
        (`deviceplane_agent_heap_settle_seconds`)."""
        found: dict[str, list[tuple[float, float]]] = {}
        for family in text_string_to_metric_families(http_get(self.port, "/metrics").decode()):
            if family.name not in ("deviceplane_agent_gc_pause_seconds", "deviceplane_agent_heap_settle_seconds"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    series = sample.labels.get("generation") or sample.labels["kind"]
                    found.setdefault(series, []).append((float(sample.labels["le"]), sample.value))
        return {series: sorted(buckets) for series, buckets in found.items()}


def during(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> tuple[int, float]:
    """Collections between two scrapes, and the smallest bucket bound holding the longest of them."""
    counts = [(bound, later - earlier) for (bound, earlier), (_, later) in zip(before, after, strict=True)]
    total = int(counts[-1][1])
    longest = next((bound for bound, count in counts if count >= total), 0.0) if total else 0.0
    return total, longest


def one_run(settle_interval: str | None, args: argparse.Namespace) -> dict[str, float]:
    reps, pods, held = args.reps, args.pods, args.held
    with tempfile.TemporaryDirectory(prefix="gc-pauses-") as tmp:
        side = SettledAgentSide(Path(tmp), settle_interval)
        sims = []
        side.start()
        try:
            sims += start_cell_sims(side, held)
            warm_up(side, 8)
            before = side.pauses()  # the start's own settle (or collections) left out
            sustained(side, 8, args.sustained)
            # pods come in bursts: the agent idles between them
            cells = [cell for level in rounds_of_cells(side, held, reps, pods, args.idle).values() for cell in level]
            slow = sum(1 for cell in cells for seconds in cell if seconds > SLOW_SECONDS)
            p99s = [percentile(cell, 0.99) for cell in cells]
            after = side.pauses()
            result = {
                "slow": slow,
                "admissions": len(cells) * pods,
                "worst_p99": max(p99s),
                "median_p99": statistics.median(p99s),
                "rss": side.rss_mib(),
            }
            for series in ("0", "1", "2", "recent", "full"):
                count, longest = during(before[series], after[series])
                result[series], result[f"{series}_longest"] = count, longest
            return result
        finally:
            stop_procs(sims)
            side.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs per setting, settings alternated [2]")
    parser.add_argument("--reps", type=int, default=3, help="rounds of cells at each held level [3]")
    parser.add_argument("--pods", type=int, default=200, help="admissions per cell [200]")
    parser.add_argument("--held", type=int, default=5000, help="containers held in the second half [5000]")
    parser.add_argument("--idle", type=float, default=0.5, help="seconds without traffic after each round [0.5]")
    parser.add_argument("--sustained", type=int, default=1000, help="pods per sustained batch, 3 batches [1000]")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for run in range(args.runs):
        order = list(SETTINGS.items()) if run % 2 == 0 else list(reversed(SETTINGS.items()))
        for name, interval in order:
            results[name].append(one_run(interval, args))
            r = results[name][-1]
            print(
                f"run {run + 1}, {name}: {r['slow']:.0f} of {r['admissions']:.0f} admissions > 10 ms in the "
                f"8-concurrent Allocate-only cells; their p99 median {r['median_p99'] * 1e3:.2f} ms, worst "
                f"{r['worst_p99'] * 1e3:.2f} ms; during the traffic, CPython's collections of generation 0/1/2: "
                f"{r['0']:.0f}/{r['1']:.0f}/{r['2']:.0f}, the longest <= {r['0_longest'] * 1e3:g}/"
                f"{r['1_longest'] * 1e3:g}/{r['2_longest'] * 1e3:g} ms; settles recent/full {r['recent']:.0f}/"
                f"{r['full']:.0f}, the longest <= {r['recent_longest'] * 1e3:g}/{r['full_longest'] * 1e3:g} ms; "
                f"RSS {r['rss']:.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
