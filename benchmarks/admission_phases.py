"""Where a sequential admission's time goes inside the agent, beside the floor measured in the same run.

The agent runs as `deviceplane agent --debug-admit-api` with a 1,024-device sim plugin (Allocate only), as in
compare.py, but started through this script, which wraps five of its methods to note a clock reading (0.5-0.7 us
per wrapped call, measured warm with timeit; the product has no such hooks):

    admission starts      Admitter._admit entered (the pod handed to admission; durationNs starts about here)
    Allocate called       PluginClient.allocate entered (device choice done)
    request sent          lean_grpc Connection.start returned (request built, framed, written to the socket)
    response arrives      Connection.buffer_updated entered, first time after the request (bytes read)
    Allocate returned     PluginClient.allocate returned (frames parsed, the call's task woken, message parsed)
    durable write         Journal._durable_write entered / returned (the record's pwritev with RWF_DSYNC), and the
                          CPU it was issued on (sched_getcpu)
    admission ends        Admitter._admit returned

The phases are wall-clock time, not CPU: the `send` that writes the request wakes the plugin, which the scheduler may
run on the agent's CPU at once, so the plugin's work can land in "request sent" instead of "waiting" (seen in a few
runs here: ~370 us of sending, ~40 of waiting); their sum is what to compare then.

1-device pods are admitted one at a time through admit-load (compare.py's Go client), `--rounds` x `--pods`, and the
median of each phase is printed. In the same run, the floor's parts as compare.py measures them (lean_grpc's bare
Allocate round trip to the same sim, the faster of sleeping and busy-polling through the call, and a pwrite +
fdatasync of a 512-byte record in a tight loop), the same durable write issued after the CPU idled for about one
round trip, as an admission issues it, and the two in sequence with the entry's idle gap before each pair: what an
agent with no steps of its own would take per sequential admission here.

The durable write's cost depends on the CPU that issues it: a disk with one completion interrupt (this VM's
virtio-blk: one queue, its interrupt on one CPU) completes a write issued elsewhere through that CPU and a second
wake-up. So the admissions' writes are also split by the CPU they were issued on, and the floor's write is timed
pinned to each CPU in turn, beside the CPUs the filesystem's disk interrupts (from /proc/irq).

With `--fine`, more of the agent's methods are wrapped (each mark adds its ~0.6 us), and the median of every step
between consecutive marks is printed too, from the debug entry handing the pod over to the admission's task ending:
where inside the agent's own steps the time goes (the pod's record and task, device choice, the metrics, the
allocator's commit, the journal record, the settling).

    python benchmarks/admission_phases.py [--rounds 3] [--pods 1000] [--fine]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import (  # noqa: E402
    JOURNAL_RECORD_BYTES,
    MEASURED_DEVICES,
    PLAIN,
    AgentSide,
    admit_many,
    bare_sequence,
    fdatasyncs,
    lean_allocates,
    polled_lean_allocates,
    remove_many,
    sim_socket,
    start_sim,
    stop_procs,
    wait,
)

MARKS = ("start", "call", "sent", "arrived", "returned", "write", "written", "end")
PHASES = (
    ("start", "call", "admission steps before the RPC (pod checks, device choice, reservation)"),
    ("call", "sent", "request built, framed and written to the plugin's socket"),
    ("sent", "arrived", "waiting for the plugin's answer (the plugin's work and two wake-ups)"),
    ("arrived", "returned", "response read: frames parsed, the call's task woken, message parsed"),
    ("returned", "write", "after the RPC until the write: metrics, commit, journal record encoded"),
    ("write", "written", "durable write: one pwritev with RWF_DSYNC"),
    ("written", "end", "settling: the future resolved, the pod reported admitted"),
)

# --fine: every mark, in the order an admission reads them, with what the step up to it does.
FINE_MARKS = (
    ("handed", "the entry hands the pod over (AdmissionRunner.pod_set)"),
    ("recorded", "the pod recorded and its admission task made"),
    ("start", "the task's first step (a loop iteration)"),
    ("call", "pod checks, device choice, reservation"),
    ("sent", "request built, framed and written to the plugin's socket"),
    ("arrived", "waiting for the plugin's answer"),
    ("returned", "frames parsed, the call's task woken, message parsed"),
    ("counted", "the Allocate's metrics (duration, result)"),
    ("commit", "back in the admission plan"),
    ("committed", "Allocator.commit: the entry made (its response serialized) and indexed, the reservation freed"),
    ("planned", "the plan finishes, PreStartContainer calls listed (none here)"),
    ("journal", "the pod committed, its allocations listed"),
    ("write", "the journal record encoded, the write prepared"),
    ("written", "durable write: one pwritev with RWF_DSYNC"),
    ("settled", "the write's duration observed, its future resolved"),
    ("admitted", "back in the admission, the admission histogram"),
    ("end", "the pod reported admitted"),
    ("ending", "the admission's task ends (its waiters, the debug entry's answer among them, are told next)"),
)


# ---- the hooked agent (runs in the agent's process) --------------------------------------------------------------


def hooked_agent(out: str, argv: list[str], fine: bool = False) -> int:
    """Run the agent with clock readings noted at the phase boundaries (`fine`: at every FINE_MARKS step), written to
    `out` when it exits."""
    from deviceplane.agent.admission.admitter import Admitter
    from deviceplane.agent.plugins.plugin_client import PluginClient
    from deviceplane.agent.state.journal import Journal
    from deviceplane.cli import main
    from deviceplane.lean_grpc.connection import Connection

    marks: list[tuple[str, int]] = []
    note = marks.append
    clock = time.perf_counter_ns

    def around_async(cls: type, name: str, before: str | None, after: str) -> None:
        original = getattr(cls, name)

        async def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                note((before, clock()))
            try:
                return await original(self, *args, **kwargs)
            finally:
                note((after, clock()))

        setattr(cls, name, wrapped)

    def around_sync(cls: type, name: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, name)

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                note((before, clock()))
            try:
                return original(self, *args, **kwargs)
            finally:
                if after is not None:
                    note((after, clock()))

        setattr(cls, name, wrapped)

    around_async(Admitter, "_admit", "start", "end")
    around_async(PluginClient, "allocate", "call", "returned")
    around_sync(Connection, "start", None, "sent")
    around_sync(Connection, "buffer_updated", "arrived", None)
    getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    durable_write = Journal._durable_write

    def noted_write(self: Any, view: memoryview) -> int:
        note(("cpu", getcpu()))  # read before the clock: not part of the write's time
        note(("write", clock()))
        try:
            return durable_write(self, view)
        finally:
            note(("written", clock()))

    Journal._durable_write = noted_write  # type: ignore[method-assign]
    if fine:
        from deviceplane.agent.admission import admitter as admitter_module
        from deviceplane.agent.admission.plugin_calls import PluginCalls
        from deviceplane.agent.admission.runner import AdmissionRunner
        from deviceplane.agent.state.durability import AllocationStore
        from deviceplane.core import admission_plan
        from deviceplane.core.allocator import Allocator
        from deviceplane.core.pod_table import PodRecord

        around_sync(AdmissionRunner, "pod_set", "handed", "recorded")
        around_async(PluginCalls, "allocate", None, "counted")
        around_sync(Allocator, "commit", "commit", "committed")
        around_sync(AllocationStore, "allocated", "journal", "settled")
        around_sync(PodRecord, "admitted", "admitted", None)
        around_sync(AdmissionRunner, "_ended", "ending", None)
        listed = admission_plan.pre_start_calls  # the admitter calls the name it imported from here

        def noted_pre_start_calls(*args: Any) -> Any:
            try:
                return listed(*args)
            finally:
                note(("planned", clock()))

        admitter_module.pre_start_calls = noted_pre_start_calls  # type: ignore[attr-defined,assignment]
    try:
        return main(argv)
    finally:
        Path(out).write_text(json.dumps(marks))


def phases_of(marks: list[tuple[str, int]]) -> tuple[dict[str, list[float]], list[float], dict[int, list[float]]]:
    """Per phase, the seconds of each complete admission; each one's total; and its durable write's seconds by the
    CPU that issued it. Marks outside an admission (the releases' journal writes, ListAndWatch traffic) are ignored;
    within one, the first reading of each kind counts."""
    phases: dict[str, list[float]] = {f"{a}>{b}": [] for a, b, _ in PHASES}
    totals: list[float] = []
    writes_by_cpu: dict[int, list[float]] = {}
    seen: dict[str, int] | None = None
    for kind, ns in marks:
        if kind == "start":
            seen = {"start": ns}
        elif seen is not None and kind not in seen:
            seen[kind] = ns
            if kind == "end":
                if all(k in seen for k in MARKS) and _in_order(seen):
                    for a, b, _ in PHASES:
                        phases[f"{a}>{b}"].append((seen[b] - seen[a]) / 1e9)
                    totals.append((seen["end"] - seen["start"]) / 1e9)
                    writes_by_cpu.setdefault(seen["cpu"], []).append((seen["written"] - seen["write"]) / 1e9)
                seen = None
    return phases, totals, writes_by_cpu


def steps_of(marks: list[tuple[str, int]]) -> dict[str, list[float]]:
    """--fine: per step between consecutive FINE_MARKS, the seconds of each admission that has every mark in order
    (the first reading of each kind counts, from the pod handed over)."""
    kinds = [kind for kind, _ in FINE_MARKS]
    steps: dict[str, list[float]] = {kind: [] for kind in kinds[1:]}
    seen: dict[str, int] | None = None
    for kind, ns in marks:
        if kind == "handed":
            seen = {"handed": ns}
        elif seen is not None and kind in kinds and kind not in seen:
            seen[kind] = ns
            if kind == "ending":
                if all(k in seen for k in kinds) and [seen[k] for k in kinds] == sorted(seen.values()):
                    for before, after in itertools.pairwise(kinds):
                        steps[after].append((seen[after] - seen[before]) / 1e9)
                seen = None
    return steps


def _in_order(seen: dict[str, int]) -> bool:
    readings = [seen[k] for k in MARKS]
    return readings == sorted(readings)


# ---- the benchmark -------------------------------------------------------------------------------------------------


class HookedAgentSide(AgentSide):
    def __init__(self, work: Path, fine: bool = False) -> None:
        super().__init__(work)
        self.marks_file = work / "marks.json"
        self.fine = fine

    def argv(self) -> list[str]:
        plain = super().argv()
        hooks = ["--hooked-agent", str(self.marks_file), *(["--fine"] if self.fine else [])]
        return [plain[0], __file__, *hooks, "--", *plain[3:]]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:7.0f}"


def run(rounds: int, pods: int, fine: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="phases-") as tmp:
        side = HookedAgentSide(Path(tmp), fine)
        side.plugin_dir.mkdir(parents=True)
        sims = [start_sim(side, PLAIN, MEASURED_DEVICES, 2, "--no-preferred-allocation", "--no-pre-start")]
        client: list[float] = []
        inside: list[float] = []
        kinds = ("rtt", "rtt slept", "rtt polled", "fdatasync", "after idle")
        kinds += ("sequence", "sequence rpc", "sequence write")
        floors: dict[str, list[float]] = {kind: [] for kind in kinds}
        cpus = sorted(os.sched_getaffinity(0))
        try:
            side.start()
            wait(lambda: side.counts(PLAIN) == (MEASURED_DEVICES, MEASURED_DEVICES), 60, "the sim registered")
            admit_many(side, "warm", PLAIN, 100, 1)
            remove_many(side, "warm", 100)
            for r in range(rounds):
                cell = admit_many(side, f"r{r}", PLAIN, pods, 1)
                remove_many(side, f"r{r}", pods)
                client += cell.latencies
                inside += cell.inside
                socket = sim_socket(side, PLAIN)
                entry_gap = max(0.0, statistics.median(cell.latencies) - statistics.median(cell.inside))
                sequence = bare_sequence(socket, side.work, 200, entry_gap)
                floors["sequence"].append(statistics.median(rpc + write for rpc, write in sequence))
                floors["sequence rpc"].append(statistics.median(rpc for rpc, _ in sequence))
                floors["sequence write"].append(statistics.median(write for _, write in sequence))
                slept = statistics.median(asyncio.run(lean_allocates(socket, 200)))
                polled = statistics.median(polled_lean_allocates(socket, 200))
                floors["rtt slept"].append(slept)
                floors["rtt polled"].append(polled)
                rtt = min(slept, polled)
                floors["rtt"].append(rtt)
                floors["fdatasync"].append(statistics.median(fdatasyncs(side.work, 200)))
                floors["after idle"].append(statistics.median(fdatasyncs(side.work, 200, idle=rtt)))
                for cpu in cpus:
                    with pinned(cpu):
                        floors.setdefault(f"cpu {cpu}", []).append(statistics.median(fdatasyncs(side.work, 200)))
        finally:
            stop_procs(sims)
            side.stop()
        marks = json.loads(side.marks_file.read_text())
        phases, totals, writes_by_cpu = phases_of(marks)
        interrupts = completion_interrupts(side.work)
    report(phases, totals, client, inside, {k: statistics.median(v) for k, v in floors.items()})
    if fine:
        report_steps(steps_of(marks))
    report_cpus(writes_by_cpu, {cpu: statistics.median(floors[f"cpu {cpu}"]) for cpu in cpus}, interrupts)


@contextlib.contextmanager
def pinned(cpu: int) -> Iterator[None]:
    """This process (the benchmark's client, not the agent) runs on `cpu` only while the block runs."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def completion_interrupts(path: Path) -> list[tuple[str, str]]:
    """The interrupts of the disk holding `path` and the CPUs they are delivered to: (name, CPU list) from
    /proc/irq, matched through the disk's device in sysfs (its virtio or PCI device name). Empty where unknown."""
    dev = os.stat(path).st_dev
    try:
        device = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    except OSError:
        return []
    names = {part for part in device.parts if part.startswith("virtio") or ":" in part}
    found = []
    for irq in sorted(Path("/proc/irq").glob("[0-9]*"), key=lambda d: int(d.name)):
        try:
            actions = [entry.name for entry in irq.iterdir() if entry.is_dir()]
            cpus = (irq / "effective_affinity_list").read_text().strip()
        except OSError:
            continue
        for action in actions:
            if any(action.startswith(name) for name in names) and not action.endswith("config"):
                found.append((action, cpus))
    return found


def report(
    phases: dict[str, list[float]],
    totals: list[float],
    client: list[float],
    inside: list[float],
    floor: dict[str, float],
) -> None:
    median: Callable[[list[float]], float] = statistics.median
    print(f"{len(totals)} sequential admissions, 1 device each, of a 1,024-device sim (Allocate only)")
    print(f"{'us (p50)':>8}  phase")
    for a, b, label in PHASES:
        print(f"{us(median(phases[f'{a}>{b}']))}   {label}")
    total = median(totals)
    wait_plugin = median(phases["sent>arrived"])
    write = median(phases["write>written"])
    print(f"{us(total)}   the admission, start to end (hooked)")
    print(f"{us(median(inside))}   durationNs as the agent reports it (p50)")
    print(f"{us(median(client))}   through the HTTP entry, as admit-load timed it (p50)")
    print(f"{us(total - wait_plugin - write)}   the agent's own steps: the admission minus the wait and the write")
    print()
    print("the floor's parts, same run (medians of the rounds' p50s):")
    print(f"{us(floor['rtt slept'])}   bare Allocate round trip, lean_grpc sleeping through the call, back to back")
    print(f"{us(floor['rtt polled'])}   the same, busy-polling through the call (as the agent waits)")
    print(f"{us(floor['rtt'])}   the round trip the floor takes: the faster of the two in each round")
    print(f"{us(floor['fdatasync'])}   pwrite + fdatasync of {JOURNAL_RECORD_BYTES} bytes, back to back")
    print(f"{us(floor['after idle'])}   the same write, each after the CPU idled for one round trip")
    sum_floor = floor["rtt"] + floor["fdatasync"]
    print(f"{us(sum_floor)}   floor (round trip + fdatasync); durationNs p50 = {median(inside) / sum_floor:.2f}x floor")
    print(
        f"{us(floor['sequence'])}   the floor's two operations in sequence, polling, with the entry's idle gap before"
        f" each: {floor['sequence'] / sum_floor:.2f}x floor (durationNs p50 = {median(inside) / floor['sequence']:.2f}x"
        " this)"
    )
    rpc = sum(median(phases[f"{a}>{b}"]) for a, b in (("call", "sent"), ("sent", "arrived"), ("arrived", "returned")))
    print(
        f"{us(floor['sequence rpc'])} + {floor['sequence write'] * 1e6:.0f}   of which its round trip + its write (the"
        f" admission's: {rpc * 1e6:.0f} + {write * 1e6:.0f}, and {(total - rpc - write) * 1e6:.0f} of its own steps)"
    )


def report_steps(steps: dict[str, list[float]]) -> None:
    counted = len(next(iter(steps.values())))
    print()
    print(f"--fine: every step, {counted} admissions with every mark in order (the marks add ~0.6 us each)")
    print(f"{'us (p50)':>8}  step (up to the mark)")
    for kind, label in FINE_MARKS[1:]:
        print(f"{us(statistics.median(steps[kind])) if steps[kind] else '      -'}   {label}  [{kind}]")
    total = sum(statistics.median(v) for v in steps.values() if v)
    print(f"{us(total)}   the steps' medians summed (handed over -> the task ends)")


def report_cpus(
    writes_by_cpu: dict[int, list[float]], floor_by_cpu: dict[int, float], interrupts: list[tuple[str, str]]
) -> None:
    print()
    where = ", ".join(f"{name} on CPU {cpus}" for name, cpus in interrupts) or "not found"
    print(f"the durable write by the CPU that issued it (the disk's completion interrupts: {where}):")
    print(f"{'us (p50)':>8}  {'floor':>7}  share  CPU")
    total = sum(len(w) for w in writes_by_cpu.values())
    for cpu in sorted(set(writes_by_cpu) | set(floor_by_cpu)):
        writes = writes_by_cpu.get(cpu, [])
        inside = us(statistics.median(writes)) if writes else f"{'-':>7}"
        floor = us(floor_by_cpu[cpu]) if cpu in floor_by_cpu else f"{'-':>7}"
        print(f"{inside}  {floor}  {len(writes) / total:5.0%}  {cpu}  (admissions' writes; the floor's, pinned here)")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--hooked-agent":
        out, rest = sys.argv[2], sys.argv[3:]
        fine = rest[:1] == ["--fine"]
        rest = rest[1:] if fine else rest
        raise SystemExit(hooked_agent(out, rest[1:] if rest[:1] == ["--"] else rest, fine))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --pods admissions [3]")
    parser.add_argument("--pods", type=int, default=1000, help="admissions per round, at most 1,024 [1000]")
    parser.add_argument("--fine", action="store_true", help="mark every step of the agent's own work too")
    args = parser.parse_args()
    if not 0 < args.pods <= MEASURED_DEVICES:
        parser.error(f"--pods must be 1..{MEASURED_DEVICES} (one device each, released after each round)")
    run(args.rounds, args.pods, args.fine)


if __name__ == "__main__":
    main()
