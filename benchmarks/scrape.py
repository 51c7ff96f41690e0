"""What one `/metrics` scrape costs the agent's event loop, by the node's device count.

`deviceplane_device_health` has a series per device. In process, from a real DeviceRegistry of 10 resources x N
devices (one in 7 unhealthy) and the agent's real AgentMetrics, median of `--rounds` scrapes each:

- through prometheus_client: the whole exposition as it was written before serving/device_health_text.py (the
  family as a GaugeMetricFamily beside the agent's other collectors, one generate_latest);
- the agent's exposition now: the first scrape (every resource's block written), a scrape with nothing changed (the
  blocks kept), and a scrape after one device of one resource changed health (that resource's block written again).

`--agent` does it end to end instead: a real agent (`--agent-source DIR` runs another checkout's, for an A/B) with 10
gRPC plugins of 10,000 devices registered, and `/metrics` fetched over HTTP. What a scrape costs everything else the
agent does is how long it holds the event loop: each round sends `GET /metrics` and, on a second connection at once,
`GET /healthz`, whose answer waits for the loop; with nothing changed, and after one device's health flipped. The
same for `/api/v1/devices` without `limit` (every device listed).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from benchmarks.compare import AgentSide, poll
from benchmarks.registration import BenchPlugin, make_devices, register_big
from deviceplane.agent.serving.device_health_text import DOCUMENTATION, LABELS, NAME
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions

RESOURCES = 10


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


class HealthThroughPrometheusClient(Collector):
    """The family as the agent wrote it before: a sample per device through prometheus_client."""

    def __init__(self, reg: DeviceRegistry) -> None:
        self._registry = reg

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(NAME, DOCUMENTATION, labels=list(LABELS))
        for state in self._registry.statuses():
            for device_id in state.sorted_ids():
                family.add_metric(["node", state.name, device_id], 1.0 if device_id in state.healthy else 0.0)
        yield family


def median_ms(scrape: Callable[[], bytes], rounds: int, before: Callable[[], object] = lambda: None) -> float:
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


def in_process_row(count: int, rounds: int) -> None:
    reg = registry(count)
    metrics = AgentMetrics(reg, "node", lambda _resource: 0)
    before = CollectorRegistry(auto_describe=False)
    before.register(HealthThroughPrometheusClient(reg))
    before.register(metrics.prometheus)
    old = median_ms(lambda: generate_latest(before), rounds)

    def fresh() -> None:
        nonlocal metrics
        metrics = AgentMetrics(reg, "node", lambda _resource: 0)

    first = median_ms(lambda: metrics.exposition(), rounds, fresh)
    size = len(metrics.exposition())
    unchanged = median_ms(metrics.exposition, rounds)
    flips = iter(range(1, 10**9))

    def flip_one() -> None:
        reg.apply_snapshot("example.com/r3", "/p/3.sock", devices(count, flipped=next(flips) % count))

    flipped = median_ms(metrics.exposition, rounds, flip_one)
    print(f"{count:>8,} {size:>12,} {old:>18.2f} {first:>8.2f} {unchanged:>10.2f} {flipped:>9.2f}")


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


async def end_to_end(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="scrape-") as tmp:
        side = SourceAgentSide(Path(tmp), args.agent_source)
        side.start()
        servers: list[grpc.aio.Server] = []
        plugins: list[BenchPlugin] = []
        try:
            async with grpc.aio.insecure_channel(f"unix://{side.plugin_dir / 'kubelet.sock'}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                for i in range(RESOURCES):
                    plugins.append(await register_big(side.plugin_dir, stub, i, servers))
                    await poll(side, f"bench.example.com/big{i}", lambda c: c == (10_000, 10_000))
                print(f"a real agent{f' from {args.agent_source}' if args.agent_source else ''}, {RESOURCES} x 10,000 "
                      f"devices; ms, median [min-max] of {args.rounds} rounds")  # fmt: skip
                print(f"{'GET':>16} {'':>26} {'its time':>22} {'/healthz sent beside it':>24} {'bytes':>12}")
                cases = [(path, flip) for path in args.paths for flip in (False, True)]
                for path, flip in cases:
                    scrapes, probes, size = [], [], 0
                    for round_ in range(args.rounds):
                        if flip:
                            plugins[3].push(make_devices(10_000, unhealthy=round_ % 2 + 1, prefix="big3"))
                            await poll(side, "bench.example.com/big3", lambda c, n=round_ % 2 + 1: c[1] == 10_000 - n)
                        took, probed, size = await asyncio.to_thread(scrape_round, side.port, path)
                        scrapes.append(took * 1000)
                        probes.append(probed * 1000)
                    label = "one device flipped before" if flip else "nothing changed"
                    print(f"{path:>16} {label:>26} {spread(scrapes):>22} {spread(probes):>24} {size:>12,}")
        finally:
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
    parser.add_argument("--agent", action="store_true", help="a real agent over HTTP, 10 x 10,000 devices")
    parser.add_argument("--agent-source", type=Path, help="with --agent: the checkout whose agent runs")
    parser.add_argument("--paths", nargs="+", default=["/metrics", "/api/v1/devices"], help="with --agent: what to GET")
    args = parser.parse_args()
    if args.agent:
        asyncio.run(end_to_end(args))
    else:
        in_process(args)


if __name__ == "__main__":
    main()
