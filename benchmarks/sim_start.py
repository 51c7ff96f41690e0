"""How long `deviceplane plugin sim` takes to start, by device count.

Two figures per count, median of `--rounds`:

    build        SimPlugin(...) alone: the device list, its NUMA layout and the ListAndWatch message, timed in a
                 child process (nothing else of the start in it)
    first list   from the `deviceplane plugin sim` process's start until a kubelet stand-in (in this process) has
                 received its first ListAndWatch answer: Python's start and imports, the build, the gRPC server,
                 Register, the options call, and the answer sent and decoded (not looked into)

`--source DIR` imports deviceplane from another checkout (e.g. `git archive` of the commit before a change) in both,
for an A/B; this script and the kubelet stand-in stay this checkout's.

    python benchmarks/sim_start.py [--counts 0,10000,100000] [--numa 2] [--rounds 5] [--source DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.procs import child_env  # noqa: E402

RESOURCE = "example.com/sim"
# Run in a child, so the checkout under test is the one imported and each round starts from the same heap.
BUILD = """
import sys, time
from deviceplane.plugin.sim import SimPlugin
count, numa = int(sys.argv[1]), int(sys.argv[2])
started = time.perf_counter()
SimPlugin("example.com/sim", count, numa, plugin_dir="/tmp")
print(time.perf_counter() - started)
"""


def source_env(source: Path) -> dict[str, str]:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join((str(source), env["PYTHONPATH"]))
    return env


class Kubelet(pb_grpc.RegistrationServicer):
    """Register as the kubelet answers it (dial back, options, then ListAndWatch), noting when the first list came.

    Not the tests' FakeKubelet: it turns every message into a dict of every device, which would be timed too."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.first_list: asyncio.Future[tuple[float, int]] = asyncio.get_running_loop().create_future()
        self.tasks: set[asyncio.Task[None]] = set()

    async def Register(self, request: pb.RegisterRequest, context: object) -> pb.Empty:
        task = asyncio.create_task(self._follow(self.plugin_dir / request.endpoint))
        self.tasks.add(task)
        return pb.Empty()

    async def _follow(self, socket: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            await stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
            async for response in stub.ListAndWatch(pb.Empty()):
                if not self.first_list.done():
                    self.first_list.set_result((time.perf_counter(), len(response.devices)))


def build_seconds(source: Path, count: int, numa: int) -> float:
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(count), str(numa)],
        env=source_env(source),
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout)


async def first_list_seconds(source: Path, count: int, numa: int) -> float:
    with tempfile.TemporaryDirectory(prefix="dps-", dir="/tmp") as work:
        plugin_dir, log = Path(work) / "dp", Path(work) / "sim.err"
        plugin_dir.mkdir()
        kubelet = Kubelet(plugin_dir)
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(kubelet, server)
        server.add_insecure_port(f"unix:{plugin_dir / 'kubelet.sock'}")
        await server.start()
        command = [sys.executable, "-m", "deviceplane", "plugin", "sim", "--plugin-dir", str(plugin_dir)]
        with log.open("wb") as err:
            started = time.perf_counter()
            sim = await asyncio.create_subprocess_exec(
                *command, "--count", str(count), "--numa", str(numa),
                env=source_env(source), cwd=source, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        exited = asyncio.create_task(sim.wait())
        try:
            await asyncio.wait([kubelet.first_list, exited], return_when=asyncio.FIRST_COMPLETED)
            if not kubelet.first_list.done():
                raise SystemExit(f"the sim exited with {sim.returncode}: {log.read_text()}")
            received, devices = kubelet.first_list.result()
            assert devices == count, devices
            return received - started
        finally:
            if sim.returncode is None:
                sim.send_signal(signal.SIGTERM)
            await exited
            await server.stop(0)
            for task in kubelet.tasks:
                task.cancel()
            await asyncio.gather(*kubelet.tasks, return_exceptions=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="0,10000,100000", help="device counts, comma-separated [%(default)s]")
    parser.add_argument("--numa", type=int, default=2, help="NUMA nodes [%(default)s]")
    parser.add_argument("--rounds", type=int, default=5, help="runs per figure [%(default)s]")
    parser.add_argument("--source", type=Path, default=ROOT, help="checkout whose deviceplane runs [this one]")
    args = parser.parse_args()
    source = args.source.resolve()
    print(f"deviceplane from {source}; --numa {args.numa}; seconds, median of {args.rounds} [min-max]")
    print(f"{'devices':>8}  {'build':>22}  {'first list':>22}")
    for count in (int(c) for c in args.counts.split(",")):
        builds = [build_seconds(source, count, args.numa) for _ in range(args.rounds)]
        firsts = [await first_list_seconds(source, count, args.numa) for _ in range(args.rounds)]
        print(f"{count:>8,}  {shown(builds):>22}  {shown(firsts):>22}", flush=True)


def shown(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.3f} [{min(seconds):.3f}-{max(seconds):.3f}]"


if __name__ == "__main__":
    asyncio.run(main())
