"""What one durable journal-sized write costs on this machine, by what came before it: why an admission's write is
slower than the floor's.

The floor (compare.py) times its fdatasync in a tight loop of them. An admission's write never comes in such a loop:
it follows a plugin's Allocate round trip, with no disk I/O since the admission before. This times the same write
(pwritev of 512 bytes with RWF_DSYNC into a zero-filled file, as the journal writes; the floor times a pwrite and an
fdatasync, the same sync) issued:

- right after a lean_grpc Allocate to the 1,024-device sim plugin (as in an admission), and after one plus a sleep of
  0.1, 0.5 and 2 ms (the loop asleep, not spinning);
- without an Allocate, after a sleep of 0.3 and 2 ms;
- in a tight loop of writes (the floor's).

Each case `--writes` times per round, cases in turn, `--rounds` rounds; p50 of each case per round, and the sim's
CPU per iteration (all its threads, from schedstat: nanoseconds on a CPU). The sim runs beside a real agent, as in
compare.py.

    python benchmarks/write_after_idle.py [--rounds 3] [--writes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import FLOOR_REQUEST, PLAIN, AgentSide, sim_socket, start_sim, stop_procs, wait  # noqa: E402
from benchmarks.journal_directory import cpu_seconds  # noqa: E402
from deviceplane.lean_grpc.channel import Channel  # noqa: E402

ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
RECORD = b"x" * 511 + b"\n"
FILE_BYTES = 8 << 20
# (label, Allocate first, sleep before the write in seconds)
CASES = (
    ("after an Allocate", True, 0.0),
    ("after an Allocate + 0.1 ms asleep", True, 1e-4),
    ("after an Allocate + 0.5 ms asleep", True, 5e-4),
    ("after an Allocate + 2 ms asleep", True, 2e-3),
    ("no Allocate, after 0.3 ms asleep", False, 3e-4),
    ("no Allocate, after 2 ms asleep", False, 2e-3),
    ("tight loop of writes (the floor's)", False, 0.0),
)


class DurableWrites:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(self.fd, bytes(FILE_BYTES))  # real zeros, as the journal's segments
        os.fsync(self.fd)
        self.offset = 0

    def timed(self) -> float:
        started = time.perf_counter()
        os.pwritev(self.fd, [RECORD], self.offset, os.RWF_DSYNC)
        elapsed = time.perf_counter() - started
        self.offset = (self.offset + len(RECORD)) % FILE_BYTES
        return elapsed


async def measure(socket: Path, writes: DurableWrites, sim_pid: int, rounds: int, count: int) -> None:
    wire = FLOOR_REQUEST.SerializeToString()
    channel = Channel(str(socket))
    try:
        for _ in range(50):  # warm-up
            await channel.unary(ALLOCATE, wire, 10)
        found: dict[str, list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for label, allocate, sleep in CASES:
                timings = []
                before = cpu_seconds(sim_pid)
                for _ in range(count):
                    if allocate:
                        await channel.unary(ALLOCATE, wire, 10)
                    if sleep:
                        # the thread asleep; asyncio.sleep would round to the selector's 1 ms timeout resolution
                        time.sleep(sleep)  # noqa: ASYNC251
                    timings.append(writes.timed())
                sim_cpu = (cpu_seconds(sim_pid) - before) / count
                found.setdefault(label, []).append((statistics.median(timings), sim_cpu))
    finally:
        await channel.close()
    print(f"durable 512-byte write, p50 per round (us); the sim's CPU per iteration (us); {count} writes a case")
    for label, rows in found.items():
        print(
            f"{label:>36}  write {' / '.join(f'{w * 1e6:4.0f}' for w, _ in rows)}"
            f"   sim CPU {' / '.join(f'{s * 1e6:4.0f}' for _, s in rows)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every case [3]")
    parser.add_argument("--writes", type=int, default=300, help="writes per case and round [300]")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dp-write-idle-", dir="/tmp") as tmp:
        side = AgentSide(Path(tmp))
        side.plugin_dir.mkdir(parents=True)
        side.start()
        sims = [start_sim(side, PLAIN, 1024, 2, "--no-preferred-allocation", "--no-pre-start")]
        try:
            wait(lambda: side.counts(PLAIN) == (1024, 1024), 60, "the sim's devices")
            writes = DurableWrites(Path(tmp) / "write.probe")
            try:
                asyncio.run(measure(sim_socket(side, PLAIN), writes, sims[0].pid, args.rounds, args.writes))
            finally:
                os.close(writes.fd)
        finally:
            stop_procs(sims)
            side.stop()


if __name__ == "__main__":
    main()
