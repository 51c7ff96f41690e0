"""What holds the agent's event loop while admissions wait: the slow admissions of continuous traffic, and the loop's
callbacks that ran for a millisecond or more around them.

The agent runs as in compare.py (`--debug-admit-api`, 1,024-device sims, one answering Allocate only, one with
GetPreferredAllocation and PreStart, and a filler resource), started through this script, which wraps asyncio's
`Handle._run` (every callback the loop runs: a task's step, an I/O callback, a timer) to note the wall and CPU time
of each one that takes `--threshold` or more (and of garbage collections as long, which run inside them), and
`Admitter._admit` to note every admission as long (the product
has no such hooks; the wrapper costs ~1 us per callback). Traffic: compare.py's warm-up and sustained batches, then
`--reps` rounds of the four cells (Allocate only / all RPCs, sequential / 8 concurrent, `--pods` each) without a pause,
at 0 held and with 5,000 held.

Printed: the sustained batches' rate; per held level, the admissions over 10 ms in the 8-concurrent Allocate-only
cells (as the client timed them) and those cells' p99s; the checkpoint file's writes (write and fsyncs, in their
worker thread); then the long callbacks by what ran (a task's coroutine, or the callback's name): how many, the
longest wall and CPU time, how many of the slow admissions (timed inside the agent: over `--slow`, 10 ms, of the
Allocate-only sim, or with `--resource rpcs` of the sim with all RPCs) each overlapped, and how many ran while the
checkpoint file was being written.

    python benchmarks/loop_stalls.py [--reps 6] [--pods 200] [--held 5000] [--sustained 1000] [--threshold 0.001]
                                     [--slow 0.010] [--resource plain|rpcs] [--agent-source DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if len(sys.argv) > 4 and sys.argv[1] == "--hooked-agent":  # the agent's own sources first (--agent-source)
    sys.path.insert(0, sys.argv[4])

from benchmarks.compare import (  # noqa: E402
    PLAIN,
    RPCS,
    AgentSide,
    percentile,
    rounds_of_cells,
    start_cell_sims,
    stop_procs,
    sustained,
    warm_up,
)

SLOW_SECONDS = 0.010
NOTED_ADMISSION_NS = 1_000_000  # the hooked agent notes every admission this long: `--slow` may not be shorter


# ---- the hooked agent (runs in the agent's process) --------------------------------------------------------------


def hooked_agent(out: str, threshold: float, argv: list[str]) -> int:
    """Run the agent noting long loop callbacks and slow admissions, written to `out` when it exits."""
    import asyncio.events
    import gc

    from deviceplane.agent.admission.admitter import Admitter
    from deviceplane.agent.state.checkpoint_store import CheckpointStore
    from deviceplane.cli import main

    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    callbacks: list[tuple[int, int, int, str]] = []  # start, wall, CPU (ns), what ran
    admissions: list[tuple[int, int, list[str]]] = []  # start, wall (ns), resources
    threshold_ns = int(threshold * 1e9)
    run = asyncio.events.Handle._run

    def timed_run(handle: asyncio.events.Handle) -> None:
        callback = handle._callback  # type: ignore[attr-defined]  # read first: cancelling a handle clears it
        started, cpu_started = clock(), cpu()
        try:
            run(handle)
        finally:
            wall = clock() - started
            if wall >= threshold_ns:
                callbacks.append((started, wall, cpu() - cpu_started, what_ran(callback)))

    admit = Admitter._admit

    async def timed_admit(self: Admitter, record: Any) -> None:
        started = clock()
        try:
            await admit(self, record)
        finally:
            wall = clock() - started
            if wall >= NOTED_ADMISSION_NS:
                admissions.append((started, wall, sorted({r for c in record.pod.all_containers for r, _ in c.limits})))

    file_writes: list[tuple[int, int]] = []  # the checkpoint file's write and fsyncs (worker thread): start, wall

    write_encoded = CheckpointStore.write_encoded

    def timed_write(self: CheckpointStore, blob: bytes) -> None:
        started = clock()
        try:
            write_encoded(self, blob)
        finally:
            file_writes.append((started, clock() - started))

    collection_started = [0]

    def timed_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collection_started[0] = clock()
            return
        wall = clock() - collection_started[0]
        if wall >= threshold_ns:
            kind = f"(inside one of the above) garbage collection, generation {info['generation']}"
            callbacks.append((collection_started[0], wall, wall, kind))

    gc.callbacks.append(timed_collection)
    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]
    Admitter._admit = timed_admit  # type: ignore[method-assign]
    CheckpointStore.write_encoded = timed_write  # type: ignore[method-assign]
    try:
        return main(argv)
    finally:
        import deviceplane

        marks = {
            "callbacks": callbacks,
            "admissions": admissions,
            "file_writes": file_writes,
            "agent": str(Path(deviceplane.__file__).parents[1]),
        }
        Path(out).write_text(json.dumps(marks))


def what_ran(callback: Any) -> str:
    """A task's coroutine (for its steps and wake-ups), else the callback's qualified name."""
    owner = getattr(callback, "__self__", None)
    if owner is not None and hasattr(owner, "get_coro"):
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return getattr(callback, "__qualname__", type(callback).__name__)


# ---- the benchmark -------------------------------------------------------------------------------------------------


class HookedAgentSide(AgentSide):
    def __init__(self, work: Path, threshold: float, source: Path) -> None:
        super().__init__(work)
        self.marks_file = work / "loop.json"
        self.threshold = threshold
        self.source = source

    def argv(self) -> list[str]:
        plain = super().argv()
        hooks = ["--hooked-agent", str(self.marks_file), str(self.threshold), str(self.source)]
        return [plain[0], __file__, *hooks, "--", *plain[3:]]


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="loop-stalls-") as tmp:
        side = HookedAgentSide(Path(tmp), args.threshold, args.agent_source)
        sims = []
        side.start()
        try:
            sims += start_cell_sims(side, args.held)
            warm_up(side, 8)
            traffic_started = time.perf_counter_ns()  # the same clock as the agent's (CLOCK_MONOTONIC)
            rate = sustained(side, 8, args.sustained)
            cells = rounds_of_cells(side, args.held, args.reps, args.pods)
            traffic_ended = time.perf_counter_ns()
        finally:
            stop_procs(sims)
            side.stop()
        marks = json.loads(side.marks_file.read_text())
    during = [mark for mark in marks["callbacks"] if traffic_started <= mark[0] <= traffic_ended]
    resource = PLAIN if args.resource == "plain" else RPCS
    slow = [
        (started, wall) for started, wall, resources in marks["admissions"] if resources == [resource]
        if wall > args.slow * 1e9
    ]  # fmt: skip
    print(f"agent: {marks['agent']}")
    print(f"sustained 8-concurrent rate at 0 held: {rate:,.0f} admissions/s")
    writes = [(started, wall) for started, wall in marks["file_writes"] if traffic_started <= started <= traffic_ended]
    report(cells, during, slow, writes, args)


def report(
    cells: dict[int, list[list[float]]],
    callbacks: list[tuple[int, int, int, str]],
    admissions: list[tuple[int, int]],
    file_writes: list[tuple[int, int]],
    args: argparse.Namespace,
) -> None:
    for level, latencies in cells.items():
        every = [seconds for cell in latencies for seconds in cell]
        slow = sum(1 for seconds in every if seconds > SLOW_SECONDS)
        p99s = [percentile(cell, 0.99) * 1e3 for cell in latencies]
        print(
            f"{level:,} held: {slow} of {len(every)} admissions > 10 ms in the 8-concurrent Allocate-only cells; "
            f"their p99 median {statistics.median(p99s):.2f} ms, worst {max(p99s):.2f} ms"
        )
    which = "Allocate-only" if args.resource == "plain" else "all-RPCs"
    slow_ms = f"{args.slow * 1e3:g} ms"
    print(f"{which} admissions over {slow_ms} inside the agent, sequential and concurrent: {len(admissions)}")
    if file_writes:
        walls = sorted(wall / 1e6 for _, wall in file_writes)
        print(
            f"checkpoint file writes (write + fsyncs, worker thread): {len(walls)}, "
            f"median {statistics.median(walls):.1f} ms, longest {walls[-1]:.1f} ms"
        )
    print(f"loop callbacks of {args.threshold * 1e3:g} ms or more during the traffic, by what ran:")
    by_kind: dict[str, list[tuple[int, int, int]]] = {}
    for started, wall, cpu, kind in callbacks:
        by_kind.setdefault(kind, []).append((started, wall, cpu))
    print(
        f"  {'count':>6} {'longest ms':>10} {'its CPU':>8} {'of those admissions overlapped':>30} "
        f"{'during a file write':>19}  what ran"
    )
    for kind, runs in sorted(by_kind.items(), key=lambda item: -len(item[1])):
        longest = max(runs, key=lambda run: run[1])
        overlapped = sum(1 for admission in admissions if any(overlap(admission, run) for run in runs))
        writing = sum(1 for run in runs if any(overlap(write, run) for write in file_writes))
        walls = f"{len(runs):>6} {longest[1] / 1e6:>10.1f} {longest[2] / 1e6:>8.1f}"
        print(f"  {walls} {overlapped:>30} {writing:>19}  {kind}")


def overlap(admission: tuple[int, int], run: tuple[int, int, int]) -> bool:
    (admitted_at, admission_wall), (ran_at, run_wall, _) = admission, run
    return ran_at < admitted_at + admission_wall and ran_at + run_wall > admitted_at


def main() -> None:
    if len(sys.argv) > 4 and sys.argv[1] == "--hooked-agent":
        out, threshold, rest = sys.argv[2], float(sys.argv[3]), sys.argv[5:]
        raise SystemExit(hooked_agent(out, threshold, rest[1:] if rest[:1] == ["--"] else rest))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=6, help="rounds of the four cells at each held level [6]")
    parser.add_argument("--pods", type=int, default=200, help="admissions per cell [200]")
    parser.add_argument("--held", type=int, default=5000, help="containers held in the second half [5000]")
    parser.add_argument("--sustained", type=int, default=1000, help="pods per sustained batch, 3 batches [1000]")
    parser.add_argument("--threshold", type=float, default=0.001, help="seconds a callback must take to be noted")
    parser.add_argument("--slow", type=float, default=SLOW_SECONDS, help="seconds that make an admission slow [0.010]")
    parser.add_argument("--resource", choices=("plain", "rpcs"), default="plain", help="whose slow admissions [plain]")
    parser.add_argument(
        "--agent-source",
        type=Path,
        default=ROOT,
        help="the checkout whose agent runs, for an A/B against another commit (`git worktree add`) [this one]",
    )
    args = parser.parse_args()
    if args.slow * 1e9 < NOTED_ADMISSION_NS:
        parser.error(f"--slow below {NOTED_ADMISSION_NS / 1e6:g} ms: the agent notes no shorter admission")
    run(args)


if __name__ == "__main__":
    main()
