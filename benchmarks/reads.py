"""What the agent's readers cost its event loop (the loop that admits pods): a Prometheus scrape, the HTTP API's
listings, and PodResources' List and GetAllocatableResources (which monitoring agents call on every scrape).

In process (the default), `/metrics` alone: `deviceplane_device_health` has a series per device. From a real
DeviceRegistry of 10 resources x N devices (one in 7 unhealthy) and the agent's real AgentMetrics, median of
`--rounds` scrapes each:

- through prometheus_client: the whole exposition as it was written before serving/device_health_text.py (the
  family as a GaugeMetricFamily beside the agent's other collectors, one generate_latest);
- the agent's exposition now: the first scrape (every resource's block written), a scrape with nothing changed (the
  blocks kept), and a scrape after one device of one resource changed health (that resource's block written again).

`--agent`, end to end: a real agent (`--agent-source DIR` runs another checkout's, for an A/B) with 10 gRPC plugins of
10,000 devices registered and `--held` containers holding a device each (a sim's, admitted through the debug admit
API). What a read costs everything else the agent does is how long it holds the event loop: each round makes the
read and, on another connection, `GET /healthz`, whose answer waits for the loop (sent at once after an HTTP
request; 0.5 ms after a gRPC call starts, from another thread). Each read unchanged, and after a change (one
device's health flipped, one more pod admitted) before each round. `/api/v1/devices` is without `limit` (every
device listed).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks.compare import FILLER, AgentSide, admit_many, poll, start_sim, stop_procs
from benchmarks.registration import BenchPlugin, make_devices, register_big
from deviceplane.agent.plugins.contracts import DeviceEvent, DeviceEventKind
from deviceplane.agent.serving.device_health_text import TRANSITIONS, TRANSITIONS_DOCUMENTATION
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.metrics_reference import HealthThroughPrometheusClient

RESOURCES = 10
READS = ("/metrics", "/api/v1/devices", "/api/v1/pods", "List", "GetAllocatableResources")
PLAIN_FLAGS = ("--no-preferred-allocation", "--no-pre-start")


def devices(count: int, flipped: int | None = None) -> list[Device]:
    def health(i: int) -> str:
        return "Unhealthy" if (i % 7 == 0) != (i == flipped) else "Healthy"

    return [Device(f"GPU-{i:08x}-5b1c-4d7e-9a2f-3c8d", health(i), (i % 2,)) for i in range(count)]


def registry(count: int) -> DeviceRegistry:
    reg = DeviceRegistry(grace_period=300.0)
    for r in range(RESOURCES):
        name = f"example.com/r{r}"
        reg.plugin_connected(name, f"/p/{r}.sock", PluginOptions(), time.monotonic())
        reg.apply_snapshot(name, f"/p/{r}.sock", devices(count))
    return reg


def median_ms(scrape: Callable[[], object], rounds: int, before: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(rounds):
        before()
        started = time.perf_counter()
        scrape()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def in_process(args: argparse.Namespace) -> None:
    print(f"{RESOURCES} resources x N devices; ms per /metrics scrape, median of {args.rounds}")
    print(f"{'N':>8} {'bytes':>12} {'prometheus_client':>18} {'first':>8} {'unchanged':>10} {'one flip':>9}")
    for count in args.devices:
        in_process_row(count, args.rounds)
    print("every device's health flipped once (a transitions series each): ms per scrape, median of", args.rounds)
    print(f"{'N':>8} {'prometheus_client':>18} {'first':>8} {'unchanged':>10}")
    for count in args.devices:
        flipped_row(count, args.rounds)


def in_process_row(count: int, rounds: int) -> None:
    reg = registry(count)
    metrics = AgentMetrics(reg, "node", lambda _resource: 0)
    before = CollectorRegistry(auto_describe=False)
    before.register(HealthThroughPrometheusClient(reg, "node"))
    before.register(metrics.prometheus)
    old = median_ms(lambda: generate_latest(before), rounds)

    def fresh() -> None:
        nonlocal metrics
        metrics = AgentMetrics(reg, "node", lambda _resource: 0)

    first = median_ms(lambda: metrics.exposition(), rounds, fresh)
    size = sum(map(len, metrics.exposition()))
    unchanged = median_ms(metrics.exposition, rounds)
    flips = iter(range(1, 10**9))

    def flip_one() -> None:
        reg.apply_snapshot("example.com/r3", "/p/3.sock", devices(count, flipped=next(flips) % count))

    flipped = median_ms(metrics.exposition, rounds, flip_one)
    print(f"{count:>8,} {size:>12,} {old:>18.2f} {first:>8.2f} {unchanged:>10.2f} {flipped:>9.2f}")


def flipped_row(count: int, rounds: int) -> None:
    reg = registry(count)
    before = CollectorRegistry(auto_describe=False)
    before.register(HealthThroughPrometheusClient(reg, "node"))
    counter = Counter(TRANSITIONS, TRANSITIONS_DOCUMENTATION, ["node", "resource_name", "device_id"], registry=before)
    metrics = AgentMetrics(reg, "node", lambda _resource: 0)
    for state in reg.statuses():
        for device_id in state.sorted_ids():
            counter.labels("node", state.name, device_id).inc()
    before.register(metrics.prometheus)
    old = median_ms(lambda: generate_latest(before), rounds)

    def fresh() -> None:
        nonlocal metrics
        metrics = AgentMetrics(reg, "node", lambda _resource: 0)
        for state in reg.statuses():
            metrics.on_device_event(DeviceEvent(state.name, DeviceEventKind.SNAPSHOT, tuple(state.sorted_ids())))

    first = median_ms(lambda: metrics.exposition(), rounds, fresh)
    unchanged = median_ms(metrics.exposition, rounds)
    print(f"{count:>8,} {old:>18.2f} {first:>8.2f} {unchanged:>10.2f}")


class SourceAgentSide(AgentSide):
    """The agent of another checkout (its sources first on the path), for an A/B."""

    def __init__(self, work: Path, source: Path | None) -> None:
        super().__init__(work)
        self.source = source

    def argv(self) -> list[str]:
        plain = super().argv()
        if self.source is None:
            return plain
        # `-m` would put the working directory (this checkout) first on the path
        first = f"import runpy, sys; sys.path.insert(0, {str(self.source)!r}); "
        run = "runpy.run_module('deviceplane', run_name='__main__', alter_sys=True)"
        return [plain[0], "-c", first + run, *plain[3:]]


def get(port: int, path: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(f"GET {path} HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    return conn


def read_all(conn: socket.socket) -> bytes:
    with conn:
        received = bytearray()
        while chunk := conn.recv(1 << 20):
            received += chunk
        return bytes(received)


def scrape_round(port: int, path: str) -> tuple[float, float, int]:
    """(the GET's time, the /healthz sent right after it: its time, the answer's size)."""
    started = time.perf_counter()
    scrape = get(port, path)
    probe = get(port, "/healthz")
    answer = read_all(probe)
    probed = time.perf_counter() - started
    assert answer.endswith(b"ok"), answer
    body = read_all(scrape)
    return time.perf_counter() - started, probed, len(body)


def rpc_round(port: int, call: Callable[[], Any]) -> tuple[float, float, int]:
    """The same for a PodResources call: made from another thread, /healthz sent 0.5 ms after it started (a loop
    held for less than that shows as less than its length)."""
    done: dict[str, Any] = {}

    def run() -> None:
        done["answer"] = call()
        done["took"] = time.perf_counter() - started

    started = time.perf_counter()
    caller = threading.Thread(target=run)
    caller.start()
    time.sleep(0.0005)
    probed_from = time.perf_counter()
    answer = read_all(get(port, "/healthz"))
    probed = time.perf_counter() - probed_from
    assert answer.endswith(b"ok"), answer
    caller.join()
    return done["took"], probed, done["answer"].ByteSize()


async def end_to_end(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="scrape-") as tmp:
        side = SourceAgentSide(Path(tmp), args.agent_source)
        side.start()
        servers: list[grpc.aio.Server] = []
        plugins: list[BenchPlugin] = []
        sims = []
        try:
            async with grpc.aio.insecure_channel(f"unix://{side.plugin_dir / 'kubelet.sock'}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                for i in range(RESOURCES):
                    plugins.append(await register_big(side.plugin_dir, stub, i, servers))
                    await poll(side, f"bench.example.com/big{i}", lambda c: c == (10_000, 10_000))
                if args.held:
                    filler = args.held + args.rounds * len(args.reads) + 16  # a pod more per changed round
                    sims.append(start_sim(side, FILLER, filler, 0, *PLAIN_FLAGS))
                    await poll(side, FILLER, lambda c: c[1] == filler)
                    await asyncio.to_thread(admit_many, side, "held", FILLER, args.held, 8)
                pod_resources = grpc.insecure_channel(
                    f"unix://{side.work / 'pr.sock'}", options=[("grpc.max_receive_message_length", 256 << 20)]
                )
                lister = pr_grpc.PodResourcesListerStub(pod_resources)  # type: ignore[no-untyped-call]
                calls: dict[str, Callable[[], Any]] = {
                    "List": lambda: lister.List(pr.ListPodResourcesRequest()),
                    "GetAllocatableResources": lambda: lister.GetAllocatableResources(pr.AllocatableResourcesRequest()),
                }
                print(f"a real agent{f' from {args.agent_source}' if args.agent_source else ''}, {RESOURCES} x 10,000 "
                      f"devices, {args.held:,} containers holding one device each; ms, median [min-max] of "
                      f"{args.rounds} rounds")  # fmt: skip
                await asyncio.sleep(2)  # the checkpoint writes settle before RSS is read
                rss_before = side.rss_mib()
                print(f"{'read':>24} {'':>15} {'its time':>22} {'/healthz sent beside it':>24} {'bytes':>12}")
                changes = iter(range(1, 10**9))
                for read in args.reads:
                    for changed in (False, True):
                        took, probes, size = [], [], 0
                        for _ in range(args.rounds):
                            if changed:  # one device's health flipped, one more pod admitted
                                n = next(changes)
                                plugins[3].push(make_devices(10_000, unhealthy=n % 2 + 1, prefix="big3"))
                                await poll(side, "bench.example.com/big3", lambda c, u=n % 2 + 1: c[1] == 10_000 - u)
                                if args.held:
                                    await asyncio.to_thread(admit_many, side, f"more-{n}", FILLER, 1, 1)
                            if read.startswith("/"):
                                one = await asyncio.to_thread(scrape_round, side.port, read)
                            else:
                                one = await asyncio.to_thread(rpc_round, side.port, calls[read])
                            took.append(one[0] * 1000)
                            probes.append(one[1] * 1000)
                            size = one[2]
                        label = "after a change" if changed else "unchanged"
                        print(f"{read:>24} {label:>15} {spread(took):>22} {spread(probes):>24} {size:>12,}")
                pod_resources.close()
                await asyncio.sleep(2)
                print(f"the agent's RSS: {rss_before:.0f} MiB before the reads, {side.rss_mib():.0f} MiB after them")
        finally:
            stop_procs(sims)
            for plugin in plugins:
                plugin.push(None)
            await asyncio.sleep(0.2)
            for server in servers:
                await server.stop(None)
            side.stop()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[100, 1_000, 10_000], help="per resource")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agent", action="store_true", help="a real agent, 10 x 10,000 devices")
    parser.add_argument("--agent-source", type=Path, help="with --agent: the checkout whose agent runs")
    parser.add_argument("--reads", nargs="+", default=list(READS), help=f"with --agent, of {', '.join(READS)}")
    parser.add_argument("--held", type=int, default=5_000, help="with --agent: containers holding a device [5000]")
    args = parser.parse_args()
    if args.agent:
        asyncio.run(end_to_end(args))
    else:
        in_process(args)


if __name__ == "__main__":
    main()
