"""Registration and device-update figures of the agent (issue 2 targets in brackets).

- Register → device visible in /api/v1/devices, p50/p99 over 200 registrations  [p99 < 20 ms]
- one ListAndWatch snapshot of 10,000 devices applied: in-process (decode + registry) and end to end  [< 50 ms]
- agent RSS with 10 resources x 10,000 devices  [< 150 MiB]

The agent runs as its own process; the plugins are real gRPC servers on unix sockets hosted by this process.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deviceplane.agent.plugins.plugin_client import devices_from_proto
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.core.registry import DeviceRegistry, PluginOptions
from tests.support.procs import AgentProcess


class BenchPlugin(pb_grpc.DevicePluginServicer):
    def __init__(self, devices: list[pb.Device]) -> None:
        self.devices = devices
        self.queues: list[asyncio.Queue[list[pb.Device] | None]] = []

    async def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions()

    async def ListAndWatch(self, request, context):
        queue: asyncio.Queue[list[pb.Device] | None] = asyncio.Queue()
        self.queues.append(queue)
        yield pb.ListAndWatchResponse(devices=self.devices)
        while (devices := await queue.get()) is not None:
            yield pb.ListAndWatchResponse(devices=devices)

    def push(self, devices: list[pb.Device] | None) -> None:
        if devices is not None:
            self.devices = devices
        for queue in self.queues:
            queue.put_nowait(devices)


def make_devices(count: int, unhealthy: int = 0, prefix: str = "dev") -> list[pb.Device]:
    return [
        pb.Device(
            ID=f"{prefix}-{i:05d}",
            health="Unhealthy" if i < unhealthy else "Healthy",
            topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=i % 2)]),
        )
        for i in range(count)
    ]


async def serve_plugin(directory: Path, name: str, plugin: BenchPlugin) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{directory / name}")
    await server.start()
    return server


async def register(stub: pb_grpc.RegistrationStub, resource: str, endpoint: str) -> None:
    await stub.Register(pb.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=resource))


def fetch(agent: AgentProcess, resource: str) -> dict | None:
    url = f"{agent.url}/api/v1/devices?resource={resource}&limit=0"
    with urllib.request.urlopen(url, timeout=5) as response:
        resources = json.loads(response.read())["resources"]
    return resources[0] if resources else None


async def wait_visible(agent: AgentProcess, resource: str, check) -> None:
    while True:
        found = await asyncio.to_thread(fetch, agent, resource)
        if found is not None and check(found):
            return


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench_registration(agent: AgentProcess, stub: pb_grpc.RegistrationStub, servers: list) -> list[float]:
    latencies = []
    for i in range(200):
        name = f"reg{i}.sock"
        servers.append(await serve_plugin(agent.plugin_dir, name, BenchPlugin(make_devices(4, prefix=f"r{i}"))))
        resource = f"bench.example.com/r{i}"
        started = time.perf_counter()
        await register(stub, resource, name)
        await wait_visible(agent, resource, lambda r: r["capacity"] == 4)
        latencies.append((time.perf_counter() - started) * 1000)
    return latencies


def bench_apply_in_process() -> float:
    registry = DeviceRegistry(300)
    registry.plugin_connected("bench.example.com/big", "/s", PluginOptions(), 0)
    first = pb.ListAndWatchResponse(devices=make_devices(10_000)).SerializeToString()
    second = pb.ListAndWatchResponse(devices=make_devices(10_000, unhealthy=100)).SerializeToString()
    timings = []
    for blob in (first, second) * 5:
        started = time.perf_counter()
        message = pb.ListAndWatchResponse.FromString(blob)
        registry.apply_snapshot("bench.example.com/big", "/s", devices_from_proto(message.devices))
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


async def register_big(directory: Path, stub: pb_grpc.RegistrationStub, i: int, servers: list) -> BenchPlugin:
    """Serve `bench.example.com/big<i>` with 10,000 devices on big<i>.sock and register it."""
    plugin = BenchPlugin(make_devices(10_000, prefix=f"big{i}"))
    servers.append(await serve_plugin(directory, f"big{i}.sock", plugin))
    await register(stub, f"bench.example.com/big{i}", f"big{i}.sock")
    return plugin


async def bench_big(agent: AgentProcess, stub: pb_grpc.RegistrationStub, servers: list) -> tuple[float, float]:
    plugins = []
    for i in range(10):
        plugins.append(await register_big(agent.plugin_dir, stub, i, servers))
        await wait_visible(agent, f"bench.example.com/big{i}", lambda r: r["capacity"] == 10_000)
    timings = []
    for round_ in range(1, 6):
        snapshot = make_devices(10_000, unhealthy=round_ * 10, prefix="big0")
        started = time.perf_counter()
        plugins[0].push(snapshot)
        await wait_visible(agent, "bench.example.com/big0", lambda r, n=round_ * 10: r["unhealthy"] == n)
        timings.append((time.perf_counter() - started) * 1000)
    await asyncio.sleep(1)  # let checkpoint writes settle before reading RSS
    status = await asyncio.to_thread(Path(f"/proc/{agent.proc.pid}/status").read_text)
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return statistics.median(timings), rss_kib / 1024


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dp-bench-", dir="/tmp") as tmp:
        agent = AgentProcess(Path(tmp), "--log-level", "warning", plugin_dir=Path(tmp) / "dp").start()
        servers: list[grpc.aio.Server] = []
        try:
            async with grpc.aio.insecure_channel(f"unix://{agent.plugin_dir / 'kubelet.sock'}") as channel:
                stub = pb_grpc.RegistrationStub(channel)
                latencies = await bench_registration(agent, stub, servers)
                print(
                    f"register -> visible (200 registrations): p50 {percentile(latencies, 0.5):.2f} ms, "
                    f"p99 {percentile(latencies, 0.99):.2f} ms  [target p99 < 20 ms]"
                )
                print(
                    f"apply one 10,000-device snapshot, in process (decode + registry): "
                    f"{bench_apply_in_process():.1f} ms  [target < 50 ms]"
                )
                end_to_end, rss = await bench_big(agent, stub, servers)
                print(f"apply one 10,000-device snapshot, plugin send -> visible over HTTP: {end_to_end:.1f} ms")
                print(f"agent RSS with 10 resources x 10,000 devices (+200 small): {rss:.1f} MiB  [target < 150 MiB]")
        finally:
            agent.stop()
            for server in servers:
                await server.stop(None)


if __name__ == "__main__":
    asyncio.run(main())
