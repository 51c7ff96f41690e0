"""`deviceplane agent` flags (DESIGN, agent contract)."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

from deviceplane import logs
from deviceplane.agent.busy_poll import BUSY_POLL_SECONDS, BusyPoll
from deviceplane.agent.heap import SETTLE_INTERVAL_SECONDS
from deviceplane.agent.kube.mode import NODEDEVICES_DEBOUNCE_SECONDS, NODEDEVICES_MAX_DEVICES
from deviceplane.agent.plugins.startup_wait import STARTUP_PLUGIN_WAIT_SECONDS
from deviceplane.core.constants import (
    ALLOCATE_TIMEOUT_SECONDS,
    DEVICE_PLUGIN_PATH,
    DIAL_TIMEOUT_SECONDS,
    ENDPOINT_STOP_GRACE_PERIOD_SECONDS,
    KUBELET_POD_RESOURCES_SOCKET,
)
from deviceplane.core.names import is_utf8
from deviceplane.loop_watchdog import LOOP_STALL_SECONDS

TOPOLOGY_POLICIES = ("none", "best-effort", "restricted", "single-numa-node")


def duration(text: str) -> float:
    """`300`, `300s`, `5m`, `1h30m` → seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 300s, 5m, 1h30m)")
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)


def add_loop_stall_argument(parser: argparse.ArgumentParser) -> None:
    """`--loop-stall-seconds` (deviceplane/loop_watchdog.py), the same flag for the agent and the operator."""
    parser.add_argument(
        "--loop-stall-seconds",
        type=duration,
        default=LOOP_STALL_SECONDS,
        help="log an event loop held this long, with every thread's stack, and count it; 0 turns it off "
        f"[{LOOP_STALL_SECONDS:g}s]",
    )


def http_address(text: str) -> str:
    _host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"invalid address {text!r}: expected HOST:PORT")
    return text


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        default=Path("/var/lib/deviceplane/device-plugins"),
        help="registration socket kubelet.sock and the checkpoint live here [%(default)s]",
    )
    parser.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path("/var/lib/deviceplane/pod-resources/kubelet.sock"),
        help="serve the PodResourcesLister v1 API here [%(default)s]",
    )
    parser.add_argument(
        "--pod-manifest-dir", type=Path, default=None, help="static pods, one Pod (YAML or JSON) per file [none]"
    )
    parser.add_argument("--node-name", default=None, help="[hostname, or $NODE_NAME]")
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="publish to this cluster [in-cluster config when $KUBERNETES_SERVICE_HOST is set, else standalone]",
    )
    parser.add_argument("--standalone", action="store_true", help="no API server: nothing is published")
    parser.add_argument(
        "--require-apiserver",
        action="store_true",
        help="exit with an error if the API server cannot be reached at start [start anyway and keep retrying]",
    )
    parser.add_argument(
        "--nodedevices-debounce",
        type=duration,
        default=NODEDEVICES_DEBOUNCE_SECONDS,
        help=f"at most one NodeDevices write per this interval [{NODEDEVICES_DEBOUNCE_SECONDS:g}s]",
    )
    parser.add_argument(
        "--nodedevices-max-devices",
        type=int,
        default=NODEDEVICES_MAX_DEVICES,
        help="devices listed per resource in NodeDevices (counts stay exact) [%(default)s]",
    )
    parser.add_argument("--topology-policy", choices=TOPOLOGY_POLICIES, default="none", help="[%(default)s]")
    parser.add_argument("--numa-nodes", type=int, default=None, help="[read from /sys/devices/system/node]")
    parser.add_argument(
        "--grace-period",
        type=duration,
        default=ENDPOINT_STOP_GRACE_PERIOD_SECONDS,
        help="how long a disconnected plugin's resource stays before it is deleted "
        f"[{ENDPOINT_STOP_GRACE_PERIOD_SECONDS:g}s]",
    )
    parser.add_argument(
        "--http-addr",
        type=http_address,
        default="127.0.0.1:9450",
        help="/metrics, /healthz, /readyz, /api/v1/devices, /api/v1/pods [%(default)s]",
    )
    parser.add_argument(
        "--plugins-registry-dir",
        type=Path,
        default=None,
        help="also accept plugin-watcher registrations (sockets created in this directory)",
    )
    parser.add_argument(
        "--plugin-dial-timeout",
        type=duration,
        default=DIAL_TIMEOUT_SECONDS,
        help="deadline for dialling a registering plugin and asking its options, together "
        f"[{DIAL_TIMEOUT_SECONDS:g}s: the kubelet's dial's]",
    )
    parser.add_argument(
        "--allocate-timeout",
        type=duration,
        default=ALLOCATE_TIMEOUT_SECONDS,
        help="deadline of each Allocate / GetPreferredAllocation RPC "
        f"[{ALLOCATE_TIMEOUT_SECONDS:g}s; the kubelet has none]",
    )
    parser.add_argument(
        "--startup-plugin-wait",
        type=duration,
        default=STARTUP_PLUGIN_WAIT_SECONDS,
        help="after start, how long an admission waits for its resources' plugins to come back, and the first "
        "NodeDevices write for the restored resources' plugins "
        f"[{STARTUP_PLUGIN_WAIT_SECONDS:g}s]",
    )
    parser.add_argument(
        "--mode",
        choices=("agent", "proxy"),
        default="agent",
        help="agent: allocate for a kubelet-less node; proxy: sit between the plugins and a real kubelet [%(default)s]",
    )
    parser.add_argument(
        "--kubelet-dir",
        type=Path,
        default=Path(DEVICE_PLUGIN_PATH),
        help="proxy mode: the kubelet's device-plugin directory (its kubelet.sock) [%(default)s]",
    )
    parser.add_argument(
        "--kubelet-pod-resources-socket",
        type=Path,
        default=Path(KUBELET_POD_RESOURCES_SOCKET),
        help="proxy mode: the kubelet's PodResources socket, polled for device owners [%(default)s]",
    )
    parser.add_argument(
        "--debug-admit-api",
        metavar="127.0.0.1:PORT",
        help="benchmarking aid: POST /debug/v1/admit and /debug/v1/remove on this loopback address [off]",
    )
    add_loop_stall_argument(parser)
    parser.add_argument(
        "--busy-poll",
        type=duration,
        default=BUSY_POLL_SECONDS,
        help="while one admission alone waits for its plugin, the event loop polls instead of sleeping, for at most "
        "this long per plugin call (the CPU does not idle through the round trip, so the answer is read at once; "
        f"it costs up to that much CPU); 0 turns it off [{BUSY_POLL_SECONDS * 1000:g}ms]",
    )
    parser.add_argument(
        "--gc-settle-interval",
        type=duration,
        default=SETTLE_INTERVAL_SECONDS,
        help="run the garbage collector's full passes at quiet moments (no admission or forwarded call in flight), "
        "this often, instead of in the middle of them; 0 leaves CPython's collector as it is "
        f"[{SETTLE_INTERVAL_SECONDS:g}s]",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="[%(default)s]"
    )
    parser.add_argument(
        "--log-format", default="json", choices=("json", "text"), help="json: one object per line [%(default)s]"
    )


def run(args: argparse.Namespace) -> int:
    from deviceplane.agent.app import AgentConfig, default_node_name, run_agent
    from deviceplane.agent.kube.mode import in_cluster

    logs.setup(args.log_level, args.log_format == "json")
    if args.numa_nodes is not None and args.numa_nodes < 1:
        raise SystemExit("deviceplane agent: --numa-nodes must be at least 1")
    if args.standalone and args.kubeconfig is not None:
        raise SystemExit("deviceplane agent: --standalone and --kubeconfig exclude each other")
    if args.standalone and args.require_apiserver:
        raise SystemExit("deviceplane agent: --standalone and --require-apiserver exclude each other")
    if args.nodedevices_max_devices < 0:
        raise SystemExit("deviceplane agent: --nodedevices-max-devices must not be negative")
    debug_admit = args.debug_admit_api
    port = debug_admit.rpartition(":")[2] if debug_admit is not None else ""
    if debug_admit is not None and (
        args.mode == "proxy" or not is_loopback(debug_admit) or not (port.isascii() and port.isdigit())
    ):
        raise SystemExit(
            "deviceplane agent: --debug-admit-api needs agent mode and a loopback address (127.0.0.1:PORT)"
        )
    standalone = args.standalone or (args.kubeconfig is None and not in_cluster())
    if standalone and args.require_apiserver:
        raise SystemExit("deviceplane agent: --require-apiserver needs --kubeconfig or an in-cluster config")
    node_name = args.node_name or default_node_name()
    if not is_utf8(node_name):  # argv and the environment keep bytes that are not UTF-8 as lone surrogates
        raise SystemExit(f"deviceplane agent: the node name must be UTF-8 text, got {node_name!r}")
    config = AgentConfig(
        plugin_dir=args.plugin_dir.absolute(),
        pod_resources_socket=args.pod_resources_socket.absolute(),
        node_name=node_name,
        grace_period=args.grace_period,
        http_addr=args.http_addr,
        plugins_registry_dir=args.plugins_registry_dir.absolute() if args.plugins_registry_dir else None,
        pod_manifest_dir=args.pod_manifest_dir,
        topology_policy=args.topology_policy,
        numa_nodes=args.numa_nodes,
        standalone=standalone,
        kubeconfig=args.kubeconfig,
        dial_timeout=args.plugin_dial_timeout,
        allocate_timeout=args.allocate_timeout,
        startup_plugin_wait=args.startup_plugin_wait,
        kubelet_dir=args.kubelet_dir.absolute() if args.mode == "proxy" else None,
        kubelet_pod_resources_socket=args.kubelet_pod_resources_socket.absolute(),
        require_apiserver=args.require_apiserver,
        nodedevices_debounce=args.nodedevices_debounce,
        nodedevices_max_devices=args.nodedevices_max_devices,
        debug_admit_addr=args.debug_admit_api,
        loop_stall_seconds=args.loop_stall_seconds,
        gc_settle_interval=args.gc_settle_interval,
    )
    busy_poll = BusyPoll(args.busy_poll)
    with asyncio.Runner(loop_factory=busy_poll.event_loop) as runner:
        return runner.run(run_agent(config, busy_poll))
