"""Proxy mode in front of the kubelet's real device manager and PodResources server (our Go harness).

Unmodified upstream plugins (sample-device-plugin, generic-device-plugin) and our sim plugin register with the agent
(`--mode proxy`); the agent registers one proxy endpoint per resource with the harness. Every comparison runs the
plugin both ways in one test: registered with a harness directly, and behind the agent with another harness.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.cli import build_parser
from tests.support.pods import PodResourcesClient, listed_devices
from tests.support.procs import free_port

from .cluster import REPO, http_json
from .conftest import Agent, Harness
from .procs import Proc, Procs, wait_for
from .test_kubelet_harness import pod

SAMPLE = "example.com/resource"
SIM = "example.com/sim"
NULL = "squat.ai/null"


def kubelet_side(short_tmp: Callable[[str], Path]) -> tuple[Path, Path]:
    """A kubelet's device-plugin dir and PodResources socket path."""
    return short_tmp("kdp"), short_tmp("kpr") / "kubelet.sock"


def proxy_flags(kubelet_dir: Path, pod_resources: Path) -> list[str]:
    """The agent's flags for proxy mode in front of the kubelet at `kubelet_dir` / `pod_resources`."""
    return [
        "--mode", "proxy",
        "--kubelet-dir", str(kubelet_dir),
        "--kubelet-pod-resources-socket", str(pod_resources),
    ]  # fmt: skip


def start_proxy(
    deviceplane_agent: Callable[..., Agent], kubelet_dir: Path, pod_resources: Path, plugin_dir: Path | None = None
) -> Agent:
    return deviceplane_agent(plugin_dir=plugin_dir, extra=proxy_flags(kubelet_dir, pod_resources))


def start_sim(procs: Procs, plugin_dir: Path, count: int = 4, numa: int = 0) -> tuple[Proc, str]:
    """Our sim plugin with its control endpoint; returns the process and the control URL."""
    argv = [
        sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", SIM, "--count", str(count),
        "--numa", str(numa), "--plugin-dir", str(plugin_dir), "--control", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    p = procs.start("deviceplane-plugin-sim", argv, cwd=REPO)
    url: list[str] = []

    def printed() -> bool:
        for line in p.log.read_text(errors="replace").splitlines():
            if line.startswith("control: "):
                url.append(line.removeprefix("control: ").strip())
                return True
        return False

    wait_for("sim control address", printed, procs=[p], timeout=30)
    return p, url[0]


def py_spy_dump(pid: int) -> str:
    """Every thread's stack of a live process (py-spy, from the bench extra), for a failure message."""
    try:
        done = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"py-spy dump {pid}: {err}"
    return done.stdout + done.stderr


def counts(h: Harness, resource: str) -> tuple[int | None, int | None]:
    cap = h.capacity()
    return cap["capacity"].get(resource), cap["allocatable"].get(resource)


def admit_app(h: Harness, name: str, resource: str, n: int) -> dict[str, Any]:
    result = h.admit(pod(name, app={resource: n}))
    assert result["admitted"], result
    return result


def raw_allocate(socket: Path, device_ids: list[str]) -> tuple[str, bytes | str]:
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)])

    async def call() -> tuple[str, bytes | str]:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            method = channel.unary_unary("/v1beta1.DevicePlugin/Allocate")
            try:
                return "OK", bytes(await method(request.SerializeToString(), timeout=10))
            except grpc.aio.AioRpcError as err:
                return err.code().name, err.details() or ""

    return asyncio.run(call())


def view(agent: Agent, resource: str) -> dict[str, dict[str, Any]]:
    r = agent.resource(resource)
    return {d["id"]: d for d in r["devices"]} if r else {}


def metric(agent: Agent, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(agent.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return None


# ---- the same as direct registration -----------------------------------------------------------------------------


@dataclass
class BothWays:
    direct: Harness  # the plugin registered with it directly
    proxied: Harness  # the plugin behind the agent, the agent registered with it
    agent: Agent
    kubelet_dir: Path

    def proxy_socket(self, resource: str) -> Path:
        return self.kubelet_dir / endpoint_name(resource, self.kubelet_dir)

    def plugin_socket(self) -> Path:
        """The plugin's own socket in the agent's dir (the one plugin there)."""
        (socket,) = [p for p in self.agent.plugin_dir.iterdir() if p.is_socket() and p.name != "kubelet.sock"]
        return socket


def both_ways(kubelet_harness, start_plugin, deviceplane_agent, short_tmp, resource: str, count: int) -> BothWays:
    """One plugin instance registered with a harness directly, another behind the agent with a second harness."""
    direct = kubelet_harness(short_tmp("kha"))
    direct_plugin = start_plugin(direct.socket_dir)
    wait_for("direct capacity", lambda: counts(direct, resource) == (count, count), procs=[direct.proc, direct_plugin])
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    plugin = start_plugin(agent.plugin_dir)
    wait_for(
        "proxied capacity",
        lambda: counts(proxied, resource) == (count, count),
        procs=[proxied.proc, agent.proc, plugin],
    )
    # The same capacity and devices as with direct registration.
    assert proxied.capacity()["devices"] == direct.capacity()["devices"]
    return BothWays(direct, proxied, agent, kubelet_dir)


def test_sample_plugin_behind_proxy_matches_direct_registration(
    kubelet_harness, sample_device_plugin, deviceplane_agent, short_tmp
) -> None:
    env = both_ways(kubelet_harness, sample_device_plugin, deviceplane_agent, short_tmp, SAMPLE, 2)

    # The same Allocate, both ways: byte-for-byte the plugin's response, and the same error for a bad device.
    for ids in (["Dev-1", "Dev-2"], ["Dev-9"]):
        assert raw_allocate(env.proxy_socket(SAMPLE), ids) == raw_allocate(env.plugin_socket(), ids)
    assert raw_allocate(env.proxy_socket(SAMPLE), ["Dev-1"])[0] == "OK"

    # Through the kubelet's own admission path: the run options (from the plugin's AllocateResponse) are identical.
    a = admit_app(env.direct, "direct", SAMPLE, 2)
    b = admit_app(env.proxied, "proxied", SAMPLE, 2)
    assert b["containers"][0]["runOptions"] == a["containers"][0]["runOptions"]
    assert b["containers"][0]["devices"] == a["containers"][0]["devices"] == {SAMPLE: ["Dev-1", "Dev-2"]}

    # The agent names the pod the kubelet gave the devices to (from the harness's PodResources).
    def owners() -> set[str]:
        return {d["allocatedTo"]["pod"] for d in view(env.agent, SAMPLE).values() if d["allocatedTo"]}

    wait_for("owner in the agent's view", lambda: owners() == {"proxied"}, procs=[env.agent.proc], timeout=5)
    # The agent never allocated (no admission of its own): its pods are the kubelet's.
    assert [p["name"] for p in env.agent.pods() if p["source"] == "kubelet"] == ["proxied"]


def test_generic_device_plugin_behind_proxy_matches_direct_registration(
    kubelet_harness, generic_device_plugin, deviceplane_agent, short_tmp
) -> None:
    env = both_ways(kubelet_harness, generic_device_plugin, deviceplane_agent, short_tmp, NULL, 4)
    a = admit_app(env.direct, "direct", NULL, 4)
    b = admit_app(env.proxied, "proxied", NULL, 4)
    assert b["containers"][0]["runOptions"] == a["containers"][0]["runOptions"]
    assert b["containers"][0]["runOptions"]["devices"], b  # /dev/null device specs came through
    ids = b["containers"][0]["devices"][NULL]
    assert raw_allocate(env.proxy_socket(NULL), ids) == raw_allocate(env.plugin_socket(), ids)
    assert raw_allocate(env.proxy_socket(NULL), ids)[0] == "OK"


# ---- health and owners -------------------------------------------------------------------------------------------


def test_unhealthy_device_reaches_kubelet_and_agent_within_1s_with_its_pod(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    sim, control = start_sim(procs, agent.plugin_dir)
    wait_for("sim through the proxy", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
    admitted = admit_app(h, "holder", SIM, 1)
    (device_id,) = admitted["containers"][0]["devices"][SIM]
    wait_for(
        "owner named",
        lambda: (view(agent, SIM)[device_id]["allocatedTo"] or {}).get("pod") == "holder",
        procs=[agent.proc],
        timeout=5,
    )

    start = time.monotonic()
    http_json(f"{control}/devices/{device_id}/unhealthy", method="POST", body={})
    wait_for("harness allocatable 3", lambda: counts(h, SIM) == (4, 3), interval=0.02, timeout=1)
    assert device_id not in {d["id"] for d in h.capacity()["devices"][SIM]}  # not among the kubelet's healthy
    wait_for(
        "agent metric 0",
        lambda: metric(agent, "deviceplane_device_health", resource_name=SIM, device_id=device_id) == 0.0,
        interval=0.02,
        timeout=1,
    )
    assert time.monotonic() - start < 1.0
    flipped = view(agent, SIM)[device_id]
    assert flipped["health"] == "Unhealthy"
    assert flipped["allocatedTo"] == {"namespace": "default", "pod": "holder", "container": "app"}


# ---- restarts ----------------------------------------------------------------------------------------------------


@dataclass
class ProxiedNode:
    """A harness, the agent in front of it, the sample plugin and the sim plugin behind the agent."""

    harness: Harness
    agent: Agent
    sample: Proc
    sim: Proc
    kubelet_dir: Path
    pod_resources: Path
    sim_count: int

    def both_shown(self, h: Harness | None = None) -> bool:
        h = h or self.harness
        return counts(h, SAMPLE) == (2, 2) and counts(h, SIM) == (self.sim_count, self.sim_count)


def proxied_node(
    kubelet_harness, sample_device_plugin, deviceplane_agent, procs: Procs, short_tmp, sim_count: int
) -> ProxiedNode:
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    sample = sample_device_plugin(agent.plugin_dir)
    sim, _control = start_sim(procs, agent.plugin_dir, count=sim_count)
    node = ProxiedNode(h, agent, sample, sim, kubelet_dir, pod_resources, sim_count)
    wait_for("both proxied", node.both_shown, procs=[h.proc, agent.proc, sample, sim])
    return node


def test_agent_kill9_mid_traffic_then_restart(
    kubelet_harness, sample_device_plugin, deviceplane_agent, procs, short_tmp
) -> None:
    node = proxied_node(kubelet_harness, sample_device_plugin, deviceplane_agent, procs, short_tmp, 8)
    h, agent, sample, sim = node.harness, node.agent, node.sample, node.sim
    kubelet_dir, pod_resources, both = node.kubelet_dir, node.pod_resources, node.both_shown

    held = {name: admit_app(h, name, SIM, 2)["containers"][0]["devices"][SIM] for name in ("keep-a", "keep-b")}

    # Traffic: admit and remove 1-device pods in a loop while the agent is killed and restarted.
    stop = threading.Event()
    outcomes: list[tuple[bool, list[str]]] = []

    def traffic() -> None:
        while not stop.is_set():
            result = h.admit(pod(f"t-{uuid.uuid4().hex[:6]}", app={SIM: 1}))
            devices = result["containers"][0]["devices"].get(SIM, []) if result["admitted"] else []
            outcomes.append((result["admitted"], devices))
            if result["admitted"]:
                h.remove(result["uid"])
            time.sleep(0.02)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    time.sleep(1.0)
    os.killpg(agent.proc.pgid, signal.SIGKILL)
    procs.stop(agent.proc)
    time.sleep(0.5)
    launched = time.monotonic()
    try:
        restarted = start_proxy(deviceplane_agent, kubelet_dir, pod_resources, plugin_dir=agent.plugin_dir)
    except TimeoutError as err:
        # Seen twice in CI: the restarted agent's /readyz never answered (its loop stuck?) while the harness's /admit
        # hung. Keep what the kubelet side said, and where every thread of the agent was.
        stuck = [p for p in procs.procs if p.name == "deviceplane-agent" and p.alive()]
        stacks = "\n".join(py_spy_dump(p.pid) for p in stuck)
        raise TimeoutError(
            f"{err}\n--- kubelet-harness ({h.proc.log}):\n{h.proc.log_tail(40)}\n--- agent stacks:\n{stacks}"
        ) from None
    ready = time.monotonic()
    wait_for("re-proxied", both, procs=[h.proc, restarted.proc, sample, sim], interval=0.05, timeout=5)
    wait_for(
        "owners visible again",
        lambda: {d["allocatedTo"]["pod"] for d in view(restarted, SIM).values() if d["allocatedTo"]} >= set(held),
        procs=[restarted.proc],
        interval=0.05,
        timeout=max(0.1, 5 - (time.monotonic() - ready)),
    )
    visible = time.monotonic()
    # Within 5 s of launching the new agent (Python start-up included).
    assert visible - launched < 5.0
    print(f"agent restart: ready {ready - launched:.2f} s after launch, all visible {visible - launched:.2f} s")
    time.sleep(1.0)
    stop.set()
    worker.join(timeout=15)

    # Nothing the kubelet allocated was lost or changed, and no device is held twice.
    pods = {p["name"]: p for p in http_json(h.url + "/pods")}
    for name, ids in held.items():
        assert pods[name]["containers"][0]["devices"][SIM] == ids
    in_use = [d for p in pods.values() for c in p["containers"] for d in c["devices"].get(SIM, [])]
    assert len(in_use) == len(set(in_use)), pods
    assert any(ok for ok, _ in outcomes), "traffic never got an admission through"
    for ok, devices in outcomes:
        assert not ok or not set(devices) & {d for ids in held.values() for d in ids}, (devices, held)
    assert sim.alive() and sample.alive()


def test_harness_restart_reregisters_every_resource_within_1s(
    kubelet_harness, sample_device_plugin, deviceplane_agent, procs, short_tmp
) -> None:
    node = proxied_node(kubelet_harness, sample_device_plugin, deviceplane_agent, procs, short_tmp, 4)
    h, agent, kubelet_dir, pod_resources = node.harness, node.agent, node.kubelet_dir, node.pod_resources
    procs.stop(h.proc)
    h2 = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)  # returns once it serves
    # Measured from the new kubelet.sock's creation (the harness answers /healthz a little later).
    created = os.stat(kubelet_dir / "kubelet.sock").st_ctime
    wait_for("re-registered", lambda: node.both_shown(h2), procs=[h2.proc, agent.proc], interval=0.02, timeout=1)
    assert time.time() - created < 1.0
    # The re-registered endpoints allocate: through the proxy, for the restarted kubelet.
    assert admit_app(h2, "after", SAMPLE, 2)["containers"][0]["runOptions"]["mounts"]


def test_harness_restart_while_the_plugin_is_away_shows_what_direct_registration_shows(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """The kubelet restarts while a plugin is away: directly, the plugin is not there to register, and the kubelet
    shows the resource from its checkpoint (0 devices) until the plugin is back. The proxy must not register its
    endpoint for it meanwhile (that showed the last devices, all unhealthy, in the Node's capacity)."""
    direct = kubelet_harness(short_tmp("kha"))
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    plugins = [start_sim(procs, direct.socket_dir)[0], start_sim(procs, agent.plugin_dir)[0]]
    both_up = lambda: counts(direct, SIM) == counts(proxied, SIM) == (4, 4)  # noqa: E731
    wait_for("both up", both_up, procs=[direct.proc, proxied.proc, agent.proc, *plugins])
    for plugin in plugins:
        procs.stop(plugin)
    wait_for("both away", lambda: counts(direct, SIM)[1] == counts(proxied, SIM)[1] == 0, procs=[agent.proc])
    procs.stop(direct.proc)
    procs.stop(proxied.proc)
    direct = kubelet_harness(direct.socket_dir)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    time.sleep(1.0)  # the proxy re-registers within 1 s of a kubelet restart
    assert counts(proxied, SIM) == counts(direct, SIM) == (0, 0)
    plugins = [start_sim(procs, direct.socket_dir)[0], start_sim(procs, agent.plugin_dir)[0]]
    wait_for("both back", both_up, procs=[direct.proc, proxied.proc, agent.proc, *plugins])
    assert admit_app(proxied, "after", SIM, 1)["containers"][0]["devices"][SIM]


# 78,000 generic-device-plugin devices (ids of 40 hex digits, no topology): 53 bytes each in a ListAndWatch message,
# 55 once "Healthy" reads "Unhealthy". Their list (4,134,000 bytes) fits the kubelet's 4 MiB limit; all unhealthy
# (4,290,000 bytes) it does not.
NEAR_LIMIT_DEVICES = 78_000


def start_generic(k8s_bin: Path, procs: Procs, plugin_dir: Path, count: int) -> Proc:
    devices = json.dumps({"name": "null", "groups": [{"count": count, "paths": [{"path": "/dev/null"}]}]})
    argv = [
        str(k8s_bin / "generic-device-plugin"), "--plugin-directory", str(plugin_dir), "--domain", "squat.ai",
        "--listen", f"127.0.0.1:{free_port()}", "--device", devices,
    ]  # fmt: skip
    return procs.start("generic-device-plugin", argv)


def test_an_endpoint_the_kubelet_dropped_is_registered_again_as_a_plugin_would(
    kubelet_harness, k8s_bin, deviceplane_agent, procs, short_tmp
) -> None:
    """The kubelet ends a plugin's stream itself when it refuses a message, and never dials back: a plugin
    registered directly comes back by registering again. Here the proxy's all-unhealthy list while the plugin
    restarts is the message refused (larger than the list the plugin sent); once the plugin is back, the resource
    must come back too, as it does directly."""
    n = NEAR_LIMIT_DEVICES
    direct = kubelet_harness(short_tmp("kha"))
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    watched = [direct.proc, proxied.proc, agent.proc]
    both_up = lambda: counts(direct, NULL) == counts(proxied, NULL) == (n, n)  # noqa: E731
    plugins = [start_generic(k8s_bin, procs, d, n) for d in (direct.socket_dir, agent.plugin_dir)]
    wait_for("both up", both_up, procs=[*watched, *plugins], timeout=60)
    for plugin in plugins:
        procs.stop(plugin)
    wait_for("both away", lambda: counts(direct, NULL)[1] == counts(proxied, NULL)[1] == 0, procs=watched)
    assert "received message larger than max" in proxied.proc.log.read_text(errors="replace")  # the kubelet's drop
    # Shown: the kubelet no longer has the endpoint (it is registered again once the plugin is back).
    shown = agent.resource(NULL)
    assert shown is not None and shown["plugin"]["kubeletRegistered"] is False
    assert metric(agent, "deviceplane_proxy_endpoint_registered", resource_name=NULL) == 0.0
    plugins = [start_generic(k8s_bin, procs, d, n) for d in (direct.socket_dir, agent.plugin_dir)]
    wait_for("both back", both_up, procs=[*watched, *plugins], timeout=30)
    wait_for(
        "shown registered again",
        lambda: metric(agent, "deviceplane_proxy_endpoint_registered", resource_name=NULL) == 1.0,
        procs=watched,
        timeout=5,
    )


# ---- the DaemonSet ----------------------------------------------------------------------------------------------


def test_proxy_daemonset_manifest_is_accepted_and_runs_the_proxy_mode(cluster) -> None:
    path = REPO / "manifests" / "31-agent-proxy.yaml"
    manifest = yaml.safe_load(path.read_text())
    cluster.kubectl("create", "namespace", "deviceplane-system", check=False)
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", str(path))
    accepted = json.loads(out)
    assert accepted["kind"] == "DaemonSet" and accepted["metadata"]["name"] == "deviceplane-agent-proxy"
    # The arguments parse with the agent's own CLI and select proxy mode with the kubelet's paths.
    args = manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser(args).parse_args(args)
    assert parsed.mode == "proxy"
    assert str(parsed.kubelet_dir) == "/var/lib/kubelet/device-plugins"
    mounts = {m["mountPath"] for m in manifest["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert {str(parsed.kubelet_dir), str(parsed.plugin_dir), str(parsed.kubelet_pod_resources_socket.parent)} <= mounts


def test_plugin_restart_keeps_the_kubelets_endpoint(kubelet_harness, deviceplane_agent, procs, short_tmp) -> None:
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    sim, _control = start_sim(procs, agent.plugin_dir)
    wait_for("sim through the proxy", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
    held = admit_app(h, "holder", SIM, 1)["containers"][0]["devices"][SIM]

    def kubelet_said(text: str) -> int:
        return h.proc.log.read_text(errors="replace").count(text)

    registered = f'"Got registration request from device plugin with resource" resourceName="{SIM}"'
    assert kubelet_said(registered) == 1
    procs.stop(sim)
    # Plugin gone: the kubelet's stream stays, its devices turn unhealthy (capacity kept, nothing allocatable).
    wait_for("devices unhealthy in the kubelet", lambda: counts(h, SIM) == (4, 0), procs=[agent.proc], timeout=5)
    sim2, _control2 = start_sim(procs, agent.plugin_dir)
    wait_for("the new plugin's devices", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim2])
    # The kubelet never saw the endpoint go: registered once, no ListAndWatch ended, the allocation unchanged.
    assert kubelet_said(registered) == 1
    assert kubelet_said("ListAndWatch ended unexpectedly") == 0
    pods = {p["name"]: p for p in http_json(h.url + "/pods")}
    assert pods["holder"]["containers"][0]["devices"][SIM] == held
    assert admit_app(h, "after", SIM, 3)["containers"][0]["devices"][
        SIM
    ]  # the other three, allocated via the new plugin


def start_sim_version(procs: Procs, plugin_dir: Path, *flags: str) -> tuple[Proc, str]:
    """The sim plugin (2 devices) as one version of an upgraded plugin; the process and its control URL."""
    port = free_port()
    argv = [
        sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", SIM, "--count", "2", "--numa", "0",
        "--plugin-dir", str(plugin_dir), "--control", f"127.0.0.1:{port}", *flags,
    ]  # fmt: skip
    return procs.start("deviceplane-plugin-sim", argv, cwd=REPO), f"http://127.0.0.1:{port}"


def pre_starts_after_upgrade(h: Harness, procs: Procs, plugin_dir: Path, watched: list[Proc]) -> int:
    """Run a plugin without PreStartContainer, replace it by a version that asks for it, admit a pod: how many
    PreStartContainer calls the new version got."""
    first, _ = start_sim_version(procs, plugin_dir, "--no-pre-start")
    wait_for("version 1 up", lambda: counts(h, SIM) == (2, 2), procs=[*watched, first])
    procs.stop(first)
    wait_for("version 1 gone", lambda: counts(h, SIM)[1] == 0, procs=watched)
    second, control = start_sim_version(procs, plugin_dir)
    wait_for("version 2 up", lambda: counts(h, SIM) == (2, 2), procs=[*watched, second])
    admit_app(h, "after-upgrade", SIM, 1)
    return int(http_json(control + "/calls")["counts"].get("PreStartContainer", 0))


def test_plugin_upgraded_with_new_options_gets_them_to_the_kubelet_as_direct(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """The kubelet asks a plugin's options only when it registers. A plugin upgraded in place to a version that needs
    PreStartContainer gets it called both ways: registered directly (it registers again itself), and behind the
    proxy (the agent registers the endpoint again when the plugin's options changed)."""
    direct = kubelet_harness(short_tmp("kha"))
    assert pre_starts_after_upgrade(direct, procs, direct.socket_dir, [direct.proc]) == 1
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    proxied = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    assert pre_starts_after_upgrade(proxied, procs, agent.plugin_dir, [proxied.proc, agent.proc]) == 1


def test_a_pod_admitted_as_soon_as_an_upgraded_plugins_devices_show_gets_its_new_options(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """Directly, the kubelet asks an upgraded plugin's options before it sees any of its devices. Behind the proxy the
    new version's devices must not reach the kubelet as healthy before the endpoint is registered again with the new
    options: a pod admitted the moment they show would start without the PreStartContainer the plugin now needs."""
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    watched = [h.proc, agent.proc]
    for attempt in range(4):  # the window was a tick (0.1 s) plus a registration: most attempts hit it
        first, _ = start_sim_version(procs, agent.plugin_dir, "--no-pre-start")
        wait_for("version 1 up", lambda: counts(h, SIM) == (2, 2), procs=[*watched, first])
        procs.stop(first)
        wait_for("version 1 gone", lambda: counts(h, SIM)[1] == 0, procs=watched)
        second, control = start_sim_version(procs, agent.plugin_dir)
        wait_for("version 2's devices", lambda: counts(h, SIM) == (2, 2), procs=[*watched, second], interval=0.001)
        admitted = admit_app(h, f"upgraded-{attempt}", SIM, 1)
        calls = int(http_json(control + "/calls")["counts"].get("PreStartContainer", 0))
        assert calls == 1, f"attempt {attempt}: PreStartContainer called {calls} times"
        h.remove(admitted["uid"])
        procs.stop(second)
        wait_for("version 2 gone", lambda: counts(h, SIM)[1] == 0, procs=watched)


def connections_to(socket: Path) -> int:
    """Connected unix sockets on the server side of `socket` (from /proc/net/unix): the clients it has now."""
    connected = "03"  # SS_CONNECTED
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return sum(1 for row in rows if len(row) == 8 and row[5] == connected and row[7].endswith(str(socket)))


def test_plugin_options_changes_leave_the_kubelet_one_client_of_the_endpoint(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """A plugin that re-registers with the kubelet directly after an upgrade leaves no client behind: its old process
    and socket are gone. The proxy's endpoint stays, and the kubelet keeps a client it replaces (reading its stream,
    every update applied once more) for as long as that stream stays open: each options change must not add one."""
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    endpoint = kubelet_dir / endpoint_name(SIM, kubelet_dir)
    watched = [h.proc, agent.proc]
    plugin, _ = start_sim_version(procs, agent.plugin_dir)
    wait_for("first version up", lambda: counts(h, SIM) == (2, 2), procs=[*watched, plugin])
    assert connections_to(endpoint) == 1
    for version in range(3):  # alternately without and with PreStartContainer
        procs.stop(plugin)
        wait_for("gone", lambda: counts(h, SIM)[1] == 0, procs=watched)
        plugin, control = start_sim_version(procs, agent.plugin_dir, *(("--no-pre-start",) if version % 2 == 0 else ()))
        wait_for("next version up", lambda: counts(h, SIM) == (2, 2), procs=[*watched, plugin])
        # The kubelet's replaced client has closed its connection (it does so once its stream has ended).
        wait_for("one client of the endpoint", lambda: connections_to(endpoint) == 1, procs=watched, timeout=5)
    # The client the kubelet kept is the newest: it allocates, with the options of the last version.
    admit_app(h, "after-changes", SIM, 1)
    assert int(http_json(control + "/calls")["counts"].get("PreStartContainer", 0)) == 0  # --no-pre-start: none
    time.sleep(1.0)  # a late disconnect of the newest client (kubernetes#121994) would show here
    assert counts(h, SIM) == (2, 2)
    assert admit_app(h, "after-changes-2", SIM, 1)["containers"][0]["devices"][SIM]


# ---- the harness's PodResources server (the kubelet's own) -------------------------------------------------------


def test_harness_serves_the_kubelets_pod_resources(kubelet_harness, procs, short_tmp) -> None:
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, numa_nodes=2, pod_resources_socket=pod_resources)
    sim, control = start_sim(procs, kubelet_dir, numa=2)
    wait_for("sim registered", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, sim])
    held = admit_app(h, "holder", SIM, 2)["containers"][0]["devices"][SIM]
    http_json(f"{control}/devices/sim-3/unhealthy", method="POST", body={})
    wait_for("sim-3 unhealthy", lambda: counts(h, SIM) == (4, 3), procs=[h.proc, sim])

    client = PodResourcesClient(pod_resources)
    try:
        assert listed_devices(client.list()) == {("default", "holder", "app"): {SIM: set(held)}}
        # One entry per device per NUMA node, with the plugin's topology (sim: 2 devices on each of 2 nodes).
        entries = [e for pod in client.list().pod_resources for c in pod.containers for e in c.devices]
        assert all(len(e.device_ids) == 1 and len(e.topology.nodes) == 1 for e in entries), entries
        # GetAllocatableResources: the healthy devices, allocated or not.
        allocatable = {i for e in client.allocatable().devices if e.resource_name == SIM for i in e.device_ids}
        assert allocatable == {"sim-0", "sim-1", "sim-2"}
        got = client.get("default", "holder").pod_resources
        assert got.name == "holder" and {i for e in got.containers[0].devices for i in e.device_ids} == set(held)
        with pytest.raises(grpc.RpcError, match="pod nope in namespace default not found"):
            client.get("default", "nope")
    finally:
        client.close()
