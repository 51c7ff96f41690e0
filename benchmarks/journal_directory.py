"""What keeping the journal in the device-plugin directory cost the plugins, against its own directory now.

Device plugins watch the device-plugin directory (inotify, not recursive) for kubelet.sock; ours does (plugin SDK,
`plugin/watch.py`), as NVIDIA's and Intel's do. A journal segment in that directory made every admission's durable
write an IN_MODIFY event there, which woke every such plugin, on the other CPU while the agent's write waited for
the disk. The journal now lives in `<plugin-dir>/deviceplane-journal/`.

Both layouts are run alternately, the agent as `deviceplane agent --debug-admit-api` with a 1,024-device sim plugin
(Allocate only, as in compare.py); the earlier layout by starting the agent through this script, which sets the
journal's directory name to "" (the device-plugin directory itself) before calling the CLI. Per layout and round,
`--pods` sequential 1-device admissions through admit-load, and per admission:

- the plugin's and the agent's CPU (all threads, from /proc/<pid>/task/*/schedstat: nanoseconds on a CPU);
- the inotify events a watcher of the device-plugin directory received, and how often it was woken (a real watch,
  read as events come, as a plugin reads them);
- the admission's p50 inside the agent (durationNs) and through the HTTP entry.

    python benchmarks/journal_directory.py [--rounds 4] [--pods 900]
"""

from __future__ import annotations

import argparse
import select
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import (  # noqa: E402
    MEASURED_DEVICES,
    PLAIN,
    AgentSide,
    admit_many,
    remove_many,
    start_sim,
    stop_procs,
    wait,
)
from tests.support.inotify import read_events, watch  # noqa: E402


class PluginDirLayout(AgentSide):
    """The agent with its journal in the device-plugin directory, as before."""

    def argv(self) -> list[str]:
        plain = super().argv()
        return [plain[0], __file__, "--agent-with-plugin-dir-journal", "--", *plain[3:]]


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of `pid` (schedstat's first field, in ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


class EventCounter:
    """Reads an inotify fd as events come, in a thread (as a plugin's watcher reads them: the kernel merges an event
    into an identical one still unread, so a reader that waited would count fewer)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0
        self.wakeups = 0
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if select.select([self.fd], [], [], 0.05)[0]:
                self.wakeups += 1
                self.count += len(read_events(self.fd))

    def close(self) -> None:
        self._stop.set()
        self._reader.join()


def one_round(side_class: type[AgentSide], pods: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="journal-dir-") as tmp:
        side = side_class(Path(tmp))
        side.plugin_dir.mkdir(parents=True)
        sims = [start_sim(side, PLAIN, MEASURED_DEVICES, 2, "--no-preferred-allocation", "--no-pre-start")]
        try:
            side.start()
            assert side.proc is not None
            wait(lambda: side.counts(PLAIN) == (MEASURED_DEVICES, MEASURED_DEVICES), 60, "the sim registered")
            admit_many(side, "warm", PLAIN, 100, 1)
            remove_many(side, "warm", 100)
            with watch(side.plugin_dir) as fd:
                events = EventCounter(fd)
                try:
                    plugin, agent = cpu_seconds(sims[0].pid), cpu_seconds(side.proc.pid)
                    cell = admit_many(side, "r", PLAIN, pods, 1)
                    plugin, agent = cpu_seconds(sims[0].pid) - plugin, cpu_seconds(side.proc.pid) - agent
                finally:
                    events.close()
            remove_many(side, "r", pods)
        finally:
            stop_procs(sims)
            side.stop()
    return {
        "plugin CPU per admission (us)": plugin / pods * 1e6,
        "agent CPU per admission (us)": agent / pods * 1e6,
        "events in the plugin directory per admission": events.count / pods,
        "the watcher woken per admission": events.wakeups / pods,
        "p50 inside the agent (us)": statistics.median(cell.inside) * 1e6,
        "p50 through the HTTP entry (us)": statistics.median(cell.latencies) * 1e6,
    }


def main() -> None:
    if sys.argv[1:2] == ["--agent-with-plugin-dir-journal"]:
        import deviceplane.agent.app as app
        from deviceplane.cli import main as cli

        app.JOURNAL_DIRNAME = ""  # plugin_dir / "" is the device-plugin directory itself
        raise SystemExit(cli(sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pods", type=int, default=900)
    args = parser.parse_args()
    layouts = {"journal in <plugin-dir> (before)": PluginDirLayout, "journal in deviceplane-journal/": AgentSide}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        order = list(layouts.items()) if r % 2 == 0 else list(reversed(layouts.items()))
        for name, side_class in order:
            results[name].append(one_round(side_class, args.pods))
            print(f"round {r + 1}, {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print(
        f"{args.rounds} rounds x {args.pods} sequential admissions per layout, alternated; median [min-max] of rounds"
    )
    for metric in results[next(iter(layouts))][0]:
        print(metric)
        for name, rounds in results.items():
            values = [result[metric] for result in rounds]
            print(f"  {name:36s} {statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]")


if __name__ == "__main__":
    main()
