"""Added latency per Allocate through the proxy (issue 12 target: p99 < 1 ms on this machine).

The agent runs in proxy mode as its own process; the sim plugin (`deviceplane plugin sim`) registers with it. This
process plays the kubelet: it calls Allocate with the same request on the plugin's own socket (direct) and on the
proxy endpoint the agent serves in the "kubelet" directory (proxied), interleaved so that load from other work on the
machine hits both alike. Added latency = proxied - direct, reported as the difference of the percentiles and as the
percentiles of the per-pair differences.

For scale, the same calls also go through a bare grpc.aio forwarder (this file with --bare-forwarder: a raw unary
handler awaiting the plugin, nothing else), the floor any Python proxy pays for the extra hop.

    python benchmarks/proxy.py [--calls 3000] [--devices 2]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.support.procs import AgentProcess, child_env, wait_for

RESOURCE = "example.com/sim"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def allocate_call(socket: Path) -> tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable]:
    channel = grpc.insecure_channel(f"unix://{socket}")
    grpc.channel_ready_future(channel).result(timeout=10)
    return channel, channel.unary_unary("/v1beta1.DevicePlugin/Allocate")


async def bare_forwarder(plugin_socket: str, socket: str) -> None:
    channel = grpc.aio.insecure_channel(f"unix://{plugin_socket}")
    allocate = channel.unary_unary(
        "/v1beta1.DevicePlugin/Allocate", request_serializer=None, response_deserializer=None
    )

    async def forward(request: bytes, _context: grpc.aio.ServicerContext) -> bytes:
        return bytes(await allocate(request))

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(forward)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", {"Allocate": handler}),)
    )
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    await server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="Allocate calls each way [3000]")
    parser.add_argument("--devices", type=int, default=2, help="devices per Allocate [2]")
    parser.add_argument("--bare-forwarder", nargs=2, metavar=("PLUGIN_SOCKET", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_forwarder:
        asyncio.run(bare_forwarder(*args.bare_forwarder))
        return 0

    with tempfile.TemporaryDirectory(prefix="dpb-", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        kubelet_dir = tmp / "k"
        kubelet_dir.mkdir()
        proxy_socket = kubelet_dir / endpoint_name(RESOURCE, kubelet_dir)
        agent = AgentProcess(
            tmp / "agent", "--mode", "proxy", "--kubelet-dir", str(kubelet_dir), "--log-level", "warning",
            plugin_dir=tmp / "p",
        ).start(wait=False)  # fmt: skip
        sim: subprocess.Popen[bytes] | None = None
        bare: subprocess.Popen[bytes] | None = None
        try:  # everything started is stopped, also when the agent never gets ready
            # Not /readyz: in proxy mode it also waits for the kubelet's PodResources, which this stand-in lacks.
            wait_for(lambda: agent.get_text("/healthz") == "ok", timeout=30, what="agent serving")
            sim = subprocess.Popen(
                [sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", RESOURCE, "--count", "8",
                 "--plugin-dir", str(tmp / "p"), "--no-pre-start"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(), start_new_session=True,
            )  # fmt: skip
            wait_for(lambda: proxy_socket.exists(), timeout=30, what="proxy endpoint")
            (direct_socket,) = [p for p in (tmp / "p").iterdir() if p.name.startswith("example.com_sim")]
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"sim-{i}" for i in range(args.devices)])]
            ).SerializeToString()
            bare_socket = tmp / "bare.sock"
            bare = subprocess.Popen(
                [sys.executable, __file__, "--bare-forwarder", str(direct_socket), str(bare_socket)],
                env=child_env(), start_new_session=True,
            )  # fmt: skip
            wait_for(bare_socket.exists, timeout=30, what="bare forwarder")
            direct_channel, direct = allocate_call(direct_socket)
            bare_channel, via_bare = allocate_call(bare_socket)
            proxy_channel, proxied = allocate_call(proxy_socket)
            for _ in range(200):  # warm-up: connections, caches
                assert direct(request, timeout=10) == proxied(request, timeout=10) == via_bare(request, timeout=10)
            times: dict[str, list[float]] = {"direct": [], "bare forwarder": [], "proxied": []}
            for _ in range(args.calls):
                for name, call in (("direct", direct), ("bare forwarder", via_bare), ("proxied", proxied)):
                    t0 = time.perf_counter()
                    call(request, timeout=10)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            for channel in (direct_channel, bare_channel, proxy_channel):
                channel.close()
        finally:
            for child in (sim, bare):
                if child is not None:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
            agent.stop()

    times_direct, times_proxied = times["direct"], times["proxied"]
    diffs = [p - d for p, d in zip(times_proxied, times_direct, strict=True)]
    load = os.getloadavg()
    print(f"Allocate ({args.devices} devices), {args.calls} calls each way, interleaved; sim plugin (Python)")
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        " (shared with other work: figures are upper bounds)"
    )
    for name, values in times.items():
        print(
            f"  {name:15}  p50 {percentile(values, 0.50):.3f} ms  p99 {percentile(values, 0.99):.3f} ms"
            f"  mean {statistics.fmean(values):.3f} ms"
        )
    added_p50 = percentile(times_proxied, 0.50) - percentile(times_direct, 0.50)
    added_p99 = percentile(times_proxied, 0.99) - percentile(times_direct, 0.99)
    print(f"  added (percentile difference)  p50 {added_p50:.3f} ms  p99 {added_p99:.3f} ms  [target p99 < 1 ms]")
    print(
        f"  added (per-pair difference)    p50 {percentile(diffs, 0.50):.3f} ms  p99 {percentile(diffs, 0.99):.3f} ms"
    )
    floor_p50 = percentile(times["bare forwarder"], 0.50) - percentile(times_direct, 0.50)
    floor_p99 = percentile(times["bare forwarder"], 0.99) - percentile(times_direct, 0.99)
    print(
        f"  bare grpc.aio forwarder adds    p50 {floor_p50:.3f} ms  p99 {floor_p99:.3f} ms (the floor of a Python hop)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
