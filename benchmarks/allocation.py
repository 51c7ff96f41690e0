"""Admission throughput and latency: 1-device pods from a 1,024-device sim plugin.

The real agent runs in this process (so admissions can be timed without a file watcher in the way); the sim
plugins are separate processes over real unix sockets. One admission = the Allocate RPC and the journal fdatasync
that makes it durable; with --all-rpcs the sim also asks for GetPreferredAllocation and PreStartContainer. The
kubelet-format checkpoint is rewritten in the background meanwhile, as in production.

Scenarios: sequential and 8 concurrent, with 0 and with 5,000 containers already holding devices (of a second
resource, so the 1,024 measured devices stay free). Targets: p99 < 10 ms at 0, < 15 ms at 5,000.

    python benchmarks/allocation.py [--pods 500] [--filler 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.agent.admission.runner import AdmissionRunner  # noqa: E402
from deviceplane.agent.app import Agent, AgentConfig  # noqa: E402
from deviceplane.agent.busy_poll import BUSY_POLL_SECONDS, BusyPoll  # noqa: E402
from deviceplane.core.pod_table import PodState  # noqa: E402
from deviceplane.core.pods import Container, Pod  # noqa: E402

RESOURCE = "example.com/sim"
FILLER = "example.com/filler"


def start_sim(
    plugin_dir: Path, resource: str, count: int, numa: int, log: Path, *flags: str
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", resource, "--count", str(count),
           "--numa", str(numa), "--plugin-dir", str(plugin_dir), "--log-level", "warning", *flags]  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, cwd=ROOT)


def one_device_pod(uid: str, resource: str) -> Pod:
    return Pod(uid, "bench", uid, "Pending", (), (Container("main", ((resource, 1),)),))


async def admit(controller: AdmissionRunner, pod: Pod) -> float:
    started = time.perf_counter()
    controller.pod_set("bench", pod.uid, pod)
    record = await controller.settled(pod.uid)
    elapsed = time.perf_counter() - started
    if record is None or record.state != PodState.ADMITTED:
        raise RuntimeError(f"{pod.uid}: {record.reason if record else 'gone'}")
    return elapsed


async def run_batch(controller: AdmissionRunner, prefix: str, resource: str, count: int, workers: int) -> list[float]:
    latencies: list[float] = []
    queue = [one_device_pod(f"{prefix}-{i}", resource) for i in range(count)]

    async def worker() -> None:
        while queue:
            latencies.append(await admit(controller, queue.pop()))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return latencies


def release(controller: AdmissionRunner, prefix: str, count: int) -> None:
    for i in range(count):
        controller.pod_gone("bench", f"{prefix}-{i}")


def report(label: str, latencies: list[float], wall: float) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return f"{label:<44} {len(ordered) / wall:>9.0f} {p50:>9.2f} {p99:>9.2f} {ordered[-1] * 1000:>9.2f}"


async def wait_devices(agent: Agent, resource: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = agent.registry.resource(resource)
        if state is not None and state.connected and len(state.healthy) == count:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{resource}: plugin did not register {count} devices")


async def main(args: argparse.Namespace, busy_poll: BusyPoll) -> None:
    work = Path(tempfile.mkdtemp(prefix="dp-bench-", dir="/tmp"))
    config = AgentConfig(
        plugin_dir=work / "dp",
        pod_resources_socket=work / "pr" / "kubelet.sock",
        node_name="bench",
        grace_period=300,
        http_addr="127.0.0.1:0",
        startup_plugin_wait=0,
    )
    agent = Agent(config, busy_poll)
    plugins: list[subprocess.Popen[bytes]] = []
    try:
        await agent.start()
        optional = [] if args.all_rpcs else ["--no-preferred-allocation", "--no-pre-start"]
        plugins.append(start_sim(config.plugin_dir, RESOURCE, 1024, 2, work / "sim.log", *optional))
        plain = ["--no-preferred-allocation", "--no-pre-start"]
        plugins.append(start_sim(config.plugin_dir, FILLER, args.filler + 16, 0, work / "filler.log", *plain))
        await wait_devices(agent, RESOURCE, 1024)
        await wait_devices(agent, FILLER, args.filler + 16)
        controller = agent.admission
        print(f"{'scenario':<44} {'admits/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
        await run_batch(controller, "warmup", RESOURCE, 50, 1)
        release(controller, "warmup", 50)
        for held in (0, args.filler):
            if held:
                started = time.perf_counter()
                await run_batch(controller, "filler", FILLER, held, 16)
                print(
                    f"  ({held} containers now hold {FILLER} devices; filled in {time.perf_counter() - started:.1f}s)"
                )
            for workers in (1, 8):
                label = f"{'sequential' if workers == 1 else f'{workers} concurrent'}, {held} holding"
                started = time.perf_counter()
                latencies = await run_batch(controller, f"m{held}-{workers}", RESOURCE, args.pods, workers)
                print(report(label, latencies, time.perf_counter() - started), flush=True)
                release(controller, f"m{held}-{workers}", args.pods)
        store = agent.allocation_store
        print(
            f"journal fdatasyncs: {store.journal_syncs} ({store.journal_inline_syncs} inline), "
            f"background checkpoints: {store.checkpoints} "
            f"(last took {store.last_checkpoint_seconds * 1000:.0f} ms), entries now: {len(agent.pod_devices)}"
        )
    finally:
        await agent.stop()
        for plugin in plugins:
            plugin.terminate()
            plugin.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=500, help="admissions measured per scenario [500]")
    parser.add_argument(
        "--all-rpcs", action="store_true", help="the sim also asks for GetPreferredAllocation and PreStartContainer"
    )
    parser.add_argument("--filler", type=int, default=5000, help="containers holding devices in the second run [5000]")
    parser.add_argument(
        "--busy-poll", type=float, default=BUSY_POLL_SECONDS, help="seconds, as the agent's flag; 0 off [0.001]"
    )
    arguments = parser.parse_args()
    window = BusyPoll(arguments.busy_poll)  # the agent's loop, as `deviceplane agent` makes it
    with asyncio.Runner(loop_factory=window.event_loop) as runner:
        runner.run(main(arguments, window))
