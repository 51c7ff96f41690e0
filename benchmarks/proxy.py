"""Added latency per Allocate through the proxy (issue 12 target: p99 < 1 ms on this machine).

The agent runs in proxy mode as its own process; the sim plugin (`deviceplane plugin sim`) registers with it. This
process plays the kubelet: it calls Allocate with the same request on the plugin's own socket (direct) and on the
proxy endpoint the agent serves in the "kubelet" directory (proxied), interleaved so that load from other work on the
machine hits both alike. Added latency = proxied - direct, reported as the difference of the percentiles and as the
percentiles of the per-pair differences.

    python benchmarks/proxy.py [--calls 3000] [--devices 2]
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="Allocate calls each way [3000]")
    parser.add_argument("--devices", type=int, default=2, help="devices per Allocate [2]")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dpb-", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        kubelet_dir = tmp / "k"
        kubelet_dir.mkdir()
        proxy_socket = kubelet_dir / endpoint_name(RESOURCE, kubelet_dir)
        agent = AgentProcess(
            tmp / "agent", "--mode", "proxy", "--kubelet-dir", str(kubelet_dir), "--log-level", "warning",
            plugin_dir=tmp / "p",
        ).start()  # fmt: skip
        sim = subprocess.Popen(
            [sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", RESOURCE, "--count", "8",
             "--plugin-dir", str(tmp / "p"), "--no-pre-start"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(), start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(lambda: proxy_socket.exists(), timeout=30, what="proxy endpoint")
            (direct_socket,) = [p for p in (tmp / "p").iterdir() if p.name.startswith("example.com_sim")]
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"sim-{i}" for i in range(args.devices)])]
            ).SerializeToString()
            direct_channel, direct = allocate_call(direct_socket)
            proxy_channel, proxied = allocate_call(proxy_socket)
            for _ in range(200):  # warm-up: connections, caches
                assert direct(request, timeout=10) == proxied(request, timeout=10)
            times_direct: list[float] = []
            times_proxied: list[float] = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                direct(request, timeout=10)
                t1 = time.perf_counter()
                proxied(request, timeout=10)
                t2 = time.perf_counter()
                times_direct.append((t1 - t0) * 1e3)
                times_proxied.append((t2 - t1) * 1e3)
            direct_channel.close()
            proxy_channel.close()
        finally:
            os.killpg(sim.pid, signal.SIGKILL)
            sim.wait()
            agent.stop()

    diffs = [p - d for p, d in zip(times_proxied, times_direct, strict=True)]
    load = os.getloadavg()
    print(f"Allocate ({args.devices} devices), {args.calls} calls each way, interleaved; sim plugin (Python)")
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        " (shared with other work: figures are upper bounds)"
    )
    for name, values in (("direct ", times_direct), ("proxied", times_proxied)):
        print(
            f"  {name}  p50 {percentile(values, 0.50):.3f} ms  p99 {percentile(values, 0.99):.3f} ms"
            f"  mean {statistics.fmean(values):.3f} ms"
        )
    added_p50 = percentile(times_proxied, 0.50) - percentile(times_direct, 0.50)
    added_p99 = percentile(times_proxied, 0.99) - percentile(times_direct, 0.99)
    print(f"  added (percentile difference)  p50 {added_p50:.3f} ms  p99 {added_p99:.3f} ms  [target p99 < 1 ms]")
    print(
        f"  added (per-pair difference)    p50 {percentile(diffs, 0.50):.3f} ms  p99 {percentile(diffs, 0.99):.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
