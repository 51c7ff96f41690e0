"""Added latency per Allocate through the proxy (issue 12 target: p99 < 1 ms on this machine).

The agent runs in proxy mode as its own process and a device plugin registers with it: the upstream
sample-device-plugin (Go, `--plugin sample`; needs root: it runs in a private mount namespace, as in the e2e
tests) and/or our sim plugin (Python, `--plugin sim`). A client plays the kubelet: it calls Allocate with the same
request on the plugin's own socket (direct), through a bare grpc.aio forwarder, through a bare Go forwarder, and
through the proxy endpoint the agent serves in the "kubelet" directory (proxied) - one call on each per round,
rotating which goes first, so load from other work on the machine hits all alike. The client is `allocate-bench`
(tests/k8s/allocate-bench: grpc-go and the kubelet's deviceplugin API, dialled as the kubelet dials a plugin; built
by `make k8s-bins`) or, with `--client python`, a sync grpc client in this process (it adds its own Python noise on
every path).

Added latency = proxied - direct, reported two ways: the difference of the percentiles (p99 of proxied - p99 of
direct), and the percentiles of the per-round differences (proxied - direct of the same round; its p99 also
catches a hop that is slow exactly when the plugin is fast). The bare grpc.aio forwarder (this file with
--bare-forwarder: a raw unary handler awaiting the plugin, nothing else) is the floor any Python gRPC hop pays; the
bare Go forwarder (`allocate-bench --forward`, grpc-go) what one more hop costs on this machine outside Python.

Each path's process CPU per call is printed too (from /proc, less what the process spends idle over the second
before): unlike wall-clock latency it barely moves when other work shares the machine, so it is what to compare
when judging a change.

`--against DIR` also runs an agent from another checkout (e.g. `git worktree add /tmp/base main`) with its own
plugin instance, in the same rounds: an A/B of two proxy versions under the same load (`--against .` with
`--env`: an A/B of an environment setting). `--env NAME=VALUE` goes to this checkout's agent and the bare
forwarder, `--against-env` to the other agent; e.g. `--env GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`
(docs/proxy.md, "Latency").

    python benchmarks/proxy.py [--plugin sample|sim|both] [--client go|python] [--calls 3000] [--runs N]
                               [--against DIR] [--env NAME=VALUE] [--against-env NAME=VALUE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.e2e.cluster import bin_dir
from tests.support.procs import cpu_seconds, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
KUBELET_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # hard-coded in sample-device-plugin


@dataclass(frozen=True)
class Plugin:
    label: str
    resource: str
    devices: list[str]  # every device it serves


PLUGINS = {
    "sample": Plugin("upstream sample-device-plugin (Go)", "example.com/resource", ["Dev-1", "Dev-2"]),
    "sim": Plugin("sim plugin (Python)", "example.com/sim", [f"sim-{i}" for i in range(8)]),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Children:
    """Every process this benchmark starts, each in its own session; all killed at exit."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen[bytes]] = []

    def start(
        self, argv: list[str], root: Path = ROOT, log: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        env = dict(os.environ, **(env or {}), PYTHONPATH=str(root), PYTHONUNBUFFERED="1")
        with open(log if log else os.devnull, "ab") as out:  # the child keeps its own copy
            proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=root, start_new_session=True)
        self._started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self._started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def start_agent(
    children: Children, work: Path, root: Path, env: dict[str, str]
) -> tuple[Path, subprocess.Popen[bytes]]:
    """An agent in proxy mode from checkout `root`; returns its proxy endpoint directory (the "kubelet" dir)."""
    kubelet_dir, plugin_dir = work / "k", work / "p"
    for d in (kubelet_dir, plugin_dir):
        d.mkdir(parents=True)
    port = free_port()
    agent = children.start(
        [sys.executable, "-m", "deviceplane", "agent", "--standalone", "--mode", "proxy",
         "--plugin-dir", str(plugin_dir), "--kubelet-dir", str(kubelet_dir),
         "--kubelet-pod-resources-socket", str(work / "kpr.sock"), "--pod-resources-socket", str(work / "pr.sock"),
         "--http-addr", f"127.0.0.1:{port}", "--node-name", "bench", "--log-level", "warning"],
        root=root, log=work / "agent.log", env=env,
    )  # fmt: skip

    def serving() -> bool:
        # Not /readyz: in proxy mode it also waits for the kubelet's PodResources, which this stand-in lacks.
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return bool(r.read() == b"ok")
        return False

    wait_for(serving, timeout=30, what=f"agent serving ({work / 'agent.log'})")
    return kubelet_dir, agent


def start_plugin(children: Children, kind: str, plugin_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    if kind == "sim":
        return children.start(
            [sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", PLUGINS["sim"].resource,
             "--count", "8", "--plugin-dir", str(plugin_dir), "--no-pre-start"],
            log=log,
        )  # fmt: skip
    # sample-device-plugin dials the hard-coded /var/lib/kubelet/device-plugins/kubelet.sock: a private mount
    # namespace with plugin_dir bind-mounted there (as the e2e fixture does).
    exe = bin_dir() / "sample-device-plugin"
    if os.geteuid() != 0 or not shutil.which("unshare"):
        raise SystemExit("--plugin sample needs root and util-linux unshare (or use --plugin sim)")
    KUBELET_PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
    script = f'mount --bind "$0" {KUBELET_PLUGIN_DIR} && PLUGIN_SOCK_DIR={KUBELET_PLUGIN_DIR} exec "$1"'
    # (unshare and sh exec: the pid is the plugin's)
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(plugin_dir), str(exe)]
    return children.start(argv, log=log)


def plugin_socket(plugin_dir: Path) -> Path:
    ours = ("kubelet.sock", "deviceplane")
    sockets = [p for p in plugin_dir.iterdir() if p.is_socket() and not p.name.startswith(ours)]
    assert len(sockets) == 1, sockets
    return sockets[0]


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


def go_client_path() -> Path:
    exe = bin_dir() / "allocate-bench"
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"{exe} missing: run `make k8s-bins`")
    return exe


def go_client(sockets: list[Path], devices: list[str], calls: int) -> list[list[float]]:
    exe = go_client_path()
    argv = [str(exe), "--devices", ",".join(devices), "--calls", str(calls)]
    for socket in sockets:
        argv += ["--socket", str(socket)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"allocate-bench failed: {out.stderr.strip()}")
    times: list[list[float]] = json.loads(out.stdout)["ms"]
    return times


def python_client(sockets: list[Path], devices: list[str], calls: int) -> list[list[float]]:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=devices)]
    ).SerializeToString()
    channels = [grpc.insecure_channel(f"unix://{s}") for s in sockets]
    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=10)
        allocate = [c.unary_unary("/v1beta1.DevicePlugin/Allocate") for c in channels]
        for _ in range(200):  # warm-up: connections, caches; and every path answers the same bytes
            assert len({call(request, timeout=10) for call in allocate}) == 1
        times: list[list[float]] = [[0.0] * calls for _ in sockets]
        for round_ in range(calls):
            for k in range(len(allocate)):
                i = (round_ + k) % len(allocate)
                t0 = time.perf_counter()
                allocate[i](request, timeout=10)
                times[i][round_] = (time.perf_counter() - t0) * 1e3
        return times
    finally:
        for channel in channels:
            channel.close()


@dataclass(frozen=True)
class Route:
    """One way to the plugin: its socket and the process serving it (whose CPU time is measured)."""

    name: str
    socket: Path
    pid: int


@contextlib.contextmanager
def setup(kind: str, against: Path | None, envs: tuple[dict[str, str], dict[str, str]]) -> Iterator[list[Route]]:
    """Agent(s), plugin(s) and the bare forwarder for one plugin kind."""
    plugin = PLUGINS[kind]
    children = Children()
    with tempfile.TemporaryDirectory(prefix="dpb-", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        try:
            routes: list[Route] = []
            for name, root, env in (("proxied", ROOT, envs[0]), ("proxied (--against)", against, envs[1])):
                if root is None:
                    continue
                work = tmp / str(len(routes))
                kubelet_dir, agent = start_agent(children, work, root, env)
                plugin_proc = start_plugin(children, kind, work / "p", work / "plugin.log")
                proxy_socket = kubelet_dir / endpoint_name(plugin.resource, kubelet_dir)
                wait_for(proxy_socket.exists, timeout=30, what=f"proxy endpoint ({work})")
                if not routes:
                    direct = plugin_socket(work / "p")
                    routes.append(Route("direct", direct, plugin_proc.pid))
                    bare = tmp / "bare.sock"
                    # With this checkout's agent's environment: the floor under the same grpc settings.
                    argv = [sys.executable, __file__, "--bare-forwarder", str(direct), str(bare)]
                    forwarder = children.start(argv, env=env)
                    wait_for(bare.exists, timeout=30, what="bare forwarder")
                    routes.append(Route("bare grpc.aio forwarder", bare, forwarder.pid))
                    go_bare = tmp / "go-bare.sock"
                    go = children.start([str(go_client_path()), "--forward", str(direct), "--listen", str(go_bare)])
                    wait_for(go_bare.exists, timeout=30, what="bare Go forwarder")
                    routes.append(Route("bare Go forwarder", go_bare, go.pid))
                routes.append(Route(name, proxy_socket, agent.pid))
            yield routes
        finally:
            children.stop_all()


def cpu_per_call(
    routes: list[Route], measure: Callable[[], list[list[float]]], calls: int
) -> tuple[list[list[float]], list[float]]:
    """Runs `measure`; returns its times and each route's process CPU ms per call, less what it spends idle (the
    agent's ticks: proxy reconcile, PodResources polling), measured over 1 s just before."""
    before = [cpu_seconds(r.pid) for r in routes]
    idle_start = time.monotonic()
    time.sleep(1.0)
    idle = [(cpu_seconds(r.pid) - b) / (time.monotonic() - idle_start) for r, b in zip(routes, before, strict=True)]
    before = [cpu_seconds(r.pid) for r in routes]
    start = time.monotonic()
    times = measure()
    took = time.monotonic() - start
    cpu = [
        max(0.0, cpu_seconds(r.pid) - b - rate * took) * 1e3 / calls
        for r, b, rate in zip(routes, before, idle, strict=True)
    ]
    return times, cpu


def report(
    kind: str, client: str, calls: int, devices: list[str], times: dict[str, list[float]], cpu: dict[str, float]
) -> None:
    load = os.getloadavg()
    print(
        f"Allocate ({len(devices)} devices) on {PLUGINS[kind].label}, client {client}, {calls} rounds"
        f" (one call per path each); {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    for name, values in times.items():
        # The plugin serves every path's call: its CPU is per Allocate it answers.
        process = f"the plugin {cpu[name] / len(times):.3f}" if name == "direct" else f"{cpu[name]:.3f}"
        print(
            f"  {name:24}  p50 {percentile(values, 0.50):.3f} ms  p99 {percentile(values, 0.99):.3f} ms"
            f"  mean {statistics.fmean(values):.3f} ms  | CPU per call: {process} ms"
        )
    direct = times["direct"]
    for name, values in times.items():
        if name == "direct":
            continue
        pairs = [v - d for v, d in zip(values, direct, strict=True)]
        print(
            f"  added by {name:24}  percentile difference p50 {percentile(values, 0.5) - percentile(direct, 0.5):.3f}"
            f" p99 {percentile(values, 0.99) - percentile(direct, 0.99):.3f} ms | per round p50"
            f" {percentile(pairs, 0.5):.3f} p99 {percentile(pairs, 0.99):.3f} ms"
        )
    print("  [target: added p99 < 1 ms]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", choices=["sample", "sim", "both"], default="both", help="plugin behind [both]")
    parser.add_argument("--client", choices=["go", "python"], default="go", help="who plays the kubelet [go]")
    parser.add_argument("--calls", type=int, default=3000, help="timed rounds [3000]")
    parser.add_argument("--devices", type=int, default=2, help="devices per Allocate [2]")
    parser.add_argument("--runs", type=int, default=1, help="repeat each measurement [1]")
    parser.add_argument("--against", type=Path, help="also proxy through an agent from this checkout (A/B)")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="for this checkout's agent and the forwarder"
    )
    parser.add_argument("--against-env", action="append", default=[], metavar="NAME=VALUE", help="for the other one")
    parser.add_argument("--bare-forwarder", nargs=2, metavar=("PLUGIN_SOCKET", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_forwarder:
        asyncio.run(bare_forwarder(*args.bare_forwarder))
        return 0
    kinds = ["sample", "sim"] if args.plugin == "both" else [args.plugin]
    measure = go_client if args.client == "go" else python_client
    client = "allocate-bench (Go)" if args.client == "go" else "sync grpc (Python)"
    for kind in kinds:
        devices = PLUGINS[kind].devices[: args.devices]
        envs = (dict(e.split("=", 1) for e in args.env), dict(e.split("=", 1) for e in args.against_env))
        with setup(kind, args.against, envs) as routes:
            sockets, names = [r.socket for r in routes], [r.name for r in routes]
            for _ in range(args.runs):
                times, cpu = cpu_per_call(routes, functools.partial(measure, sockets, devices, args.calls), args.calls)
                report(
                    kind,
                    client,
                    args.calls,
                    devices,
                    dict(zip(names, times, strict=True)),
                    dict(zip(names, cpu, strict=True)),
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
