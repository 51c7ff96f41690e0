"""Proxy mode with an API server: the agent in front of the kubelet harness (the kubelet's real device manager and
PodResources server) on a kwok node of the real control plane, authenticated as the proxy-mode DaemonSet's pod
would be (a token bound to that pod, nothing but the manifests' RBAC and ValidatingAdmissionPolicy).

The agent publishes NodeDevices only, with the owners the kubelet reports; the Node's capacity is the kubelet's."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.pods import PodResourcesClient, listed_devices

from .agent_cluster import (
    NAMESPACE,
    PROXY_DAEMONSET,
    SERVICE_ACCOUNT,
    Stopwatch,
    daemonset_pod,
    node_devices,
    node_status,
)
from .cluster import Cluster, http_json, http_ok
from .conftest import Agent, Harness
from .procs import Procs, wait_for
from .test_proxy import SIM, admit_app, counts, kubelet_side, metric, proxy_flags, start_sim

DEBOUNCE = 0.2
RESTART_DEBOUNCE = 1.0  # wide: a first write without the owners would stand this long before the next


def published_condition(cluster: Cluster, node: str, kind: str) -> dict[str, Any] | None:
    """The condition of type `kind` in `NodeDevices/<node>`, or None."""
    conditions = ((node_devices(cluster, node) or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def published_device(cluster: Cluster, node: str, resource: str, device_id: str) -> dict[str, Any] | None:
    """The device as `NodeDevices/<node>` shows it, or None."""
    obj = node_devices(cluster, node) or {}
    for r in (obj.get("status") or {}).get("resources") or []:
        if r["name"] == resource:
            return next((d for d in r["devices"] if d["id"] == device_id), None)
    return None


@dataclass
class ProxiedClusterNode:
    """A kwok node; the kubelet harness as its kubelet; the agent in proxy mode publishing for the node; the sim
    plugin behind the agent."""

    cluster: Cluster
    node: str
    harness: Harness
    agent: Agent
    control: str  # the sim plugin's control URL
    pod_resources: Path
    flags: list[str]  # the agent's flags but the kubeconfig and node name
    node_before: dict[str, dict[str, str]]  # the Node's capacity and allocatable before the plugin registered

    def owner_of(self, device_id: str) -> dict[str, str]:
        """The device's holder as the harness's PodResources (the kubelet's own server) reports it."""
        client = PodResourcesClient(self.pod_resources)
        try:
            listed = listed_devices(client.list())
        finally:
            client.close()
        ((namespace, pod, container),) = [k for k, v in listed.items() if device_id in v.get(SIM, set())]
        return {"namespace": namespace, "pod": pod, "container": container}

    def published_owner(self, device_id: str) -> dict[str, str] | None:
        return (published_device(self.cluster, self.node, SIM, device_id) or {}).get("allocatedTo")


def proxied_cluster_node(
    cluster: Cluster,
    start_node_agent: Callable[..., tuple[str, Agent]],
    kubelet_harness: Callable[..., Harness],
    procs: Procs,
    short_tmp: Callable[[str], Path],
    debounce: float = DEBOUNCE,
) -> ProxiedClusterNode:
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    flags = [*proxy_flags(kubelet_dir, pod_resources), "--nodedevices-debounce", f"{debounce:g}s"]
    node, agent = start_node_agent(extra=flags, proxy=True)
    before = node_status(cluster, node)
    sim, control = start_sim(procs, agent.plugin_dir)
    wait_for("sim through the proxy", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
    return ProxiedClusterNode(cluster, node, h, agent, control, pod_resources, flags, before)


def test_proxy_mode_publishes_nodedevices_with_the_kubelets_owners_and_health(
    agent_installed: Cluster,
    node_agent,
    kubelet_harness,
    procs,
    short_tmp,
) -> None:
    env = proxied_cluster_node(agent_installed, node_agent, kubelet_harness, procs, short_tmp)
    cluster, node, h, agent = env.cluster, env.node, env.harness, env.agent

    # A pod admitted by the kubelet: NodeDevices names it as the kubelet's PodResources does.
    (device_id,) = admit_app(h, "holder", SIM, 1)["containers"][0]["devices"][SIM]
    owner = env.owner_of(device_id)
    wait_for(
        "the kubelet's owner in NodeDevices",
        lambda: env.published_owner(device_id) == owner,
        procs=[agent.proc, h.proc],
        timeout=10,
    )
    resource = next(r for r in (node_devices(cluster, node) or {})["status"]["resources"] if r["name"] == SIM)
    assert (resource["capacity"], resource["healthy"], resource["allocated"]) == (4, 4, 1)

    # The plugin flips the held device unhealthy: the kubelet, NodeDevices and the metric within 1 s (+ debounce).
    clock = Stopwatch()
    clock.start()
    http_json(f"{env.control}/devices/{device_id}/unhealthy", method="POST", body={})
    clock.until("health flip -> harness allocatable", lambda: counts(h, SIM) == (4, 3), timeout=1)
    clock.until(
        "health flip -> metric",
        lambda: metric(agent, "deviceplane_device_health", resource_name=SIM, device_id=device_id) == 0.0,
        timeout=1,
    )
    took = clock.until(
        "health flip -> NodeDevices",
        lambda: (published_device(cluster, node, SIM, device_id) or {}).get("health") == "Unhealthy",
        timeout=1 + DEBOUNCE,
    )
    assert took < 1 + DEBOUNCE
    flipped = published_device(cluster, node, SIM, device_id) or {}
    assert (flipped["health"], flipped["allocatedTo"]) == ("Unhealthy", owner)  # still held by the same pod

    # The kubelet owns the Node's capacity: the agent patched nothing there (a Node status publisher would have
    # written the resource by now, before the NodeDevices write just seen).
    after = node_status(cluster, node)
    assert SIM not in after["capacity"] and SIM not in after["allocatable"], after
    assert after == env.node_before
    # Ready in this combination: the kubelet's owners listed and the first NodeDevices write succeeded.
    assert http_ok(agent.url + "/readyz")
    assert agent.proc.alive()

    # The proxy DaemonSet's pod there (the one the agent's token is bound to) has what publishing in-cluster needs:
    # no --standalone (KUBERNETES_SERVICE_HOST selects the in-cluster config), NODE_NAME, the agent's ServiceAccount
    # token mounted. (This control plane runs without the ServiceAccount admission plugin, so the projected token
    # volume itself is not added here; a real one adds it because of the automount asked for.)
    spec = cluster.get_json("pod", "-n", NAMESPACE, daemonset_pod(cluster, node, PROXY_DAEMONSET))["spec"]
    (container,) = spec["containers"]
    assert "--mode=proxy" in container["args"] and "--standalone" not in container["args"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}} in (
        container["env"]
    )
    assert (spec["serviceAccountName"], spec.get("automountServiceAccountToken")) == (SERVICE_ACCOUNT, True)

    # Whether the kubelet has the resource's endpoint is published too, and follows a kubelet restart.
    def published_registered() -> bool | None:
        resources = ((node_devices(cluster, node) or {}).get("status") or {}).get("resources") or []
        return next((r["plugin"].get("kubeletRegistered") for r in resources if r["name"] == SIM), None)

    assert published_registered() is True

    # The kubelet's PodResources stops answering (the kubelet hangs: each call times out after 2 s) while nothing
    # else changes, its endpoint registered, its stream open: OwnersCurrent turns False alone, and is written alone.
    def owners_current() -> dict[str, Any]:
        return published_condition(cluster, node, "OwnersCurrent") or {}

    current = owners_current()
    assert (current.get("status"), current.get("reason")) == ("True", "PodResourcesListed"), current
    before = (node_devices(cluster, node) or {})["status"]
    time.sleep(1.1)  # a later second for the transition time
    h.proc.popen.send_signal(signal.SIGSTOP)
    try:
        wait_for(
            "NodeDevices: owners not current",
            lambda: owners_current().get("status") == "False",
            procs=[agent.proc],
            timeout=10,
        )
        lost = owners_current()
        assert lost["reason"] == "PodResourcesUnreachable", lost
        message = lost["message"]
        assert message.startswith("kubelet PodResources unreachable since ") and "(DEADLINE_EXCEEDED" in message, lost
        assert "device owners are as of " in message and lost["lastTransitionTime"] > current["lastTransitionTime"]
        during = (node_devices(cluster, node) or {})["status"]
        assert during["resources"] == before["resources"]  # the condition alone changed: the owners are kept
        assert [c for c in during["conditions"] if c["type"] != "OwnersCurrent"] == [
            c for c in before["conditions"] if c["type"] != "OwnersCurrent"
        ]
        time.sleep(1.1)  # and a later one for the way back
    finally:
        h.proc.popen.send_signal(signal.SIGCONT)
    wait_for(
        "NodeDevices: owners current again",
        lambda: owners_current().get("status") == "True",
        procs=[agent.proc, h.proc],
        timeout=10,
    )
    back = owners_current()
    assert back["reason"] == "PodResourcesListed" and back["lastTransitionTime"] > lost["lastTransitionTime"], back

    procs.stop(h.proc)
    wait_for("NodeDevices: not registered", lambda: published_registered() is False, procs=[agent.proc], timeout=5)
    h = kubelet_harness(h.socket_dir, pod_resources_socket=env.pod_resources)
    wait_for("NodeDevices: registered again", lambda: published_registered() is True, procs=[agent.proc], timeout=5)


def test_agent_restart_never_publishes_held_devices_as_free(
    agent_installed: Cluster,
    node_agent,
    kubelet_harness,
    deviceplane_agent,
    procs,
    short_tmp,
) -> None:
    """Kill -9 and restart the agent while a pod holds a device: NodeDevices keeps naming the holder throughout (the
    restarted agent publishes once it has the kubelet's owners, not an empty ownership before)."""
    env = proxied_cluster_node(
        agent_installed, node_agent, kubelet_harness, procs, short_tmp, debounce=RESTART_DEBOUNCE
    )
    (device_id,) = admit_app(env.harness, "holder", SIM, 1)["containers"][0]["devices"][SIM]
    owner = env.owner_of(device_id)
    wait_for("the owner in NodeDevices", lambda: env.published_owner(device_id) == owner, procs=[env.agent.proc])
    current = published_condition(env.cluster, env.node, "OwnersCurrent")
    assert current is not None and current["status"] == "True", current

    seen: list[dict[str, Any] | None] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(published_device(env.cluster, env.node, SIM, device_id))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    os.killpg(env.agent.proc.pgid, signal.SIGKILL)
    procs.stop(env.agent.proc)
    argv = env.agent.proc.argv
    restarted = deviceplane_agent(
        kubeconfig=Path(argv[argv.index("--kubeconfig") + 1]),
        node_name=env.node,
        plugin_dir=env.agent.plugin_dir,
        extra=env.flags,
    )  # returns once /readyz is ok: the restarted agent has published
    time.sleep(3 * RESTART_DEBOUNCE)  # and a later write, had the first one lacked the owner
    stop.set()
    watcher.join(timeout=10)
    assert restarted.proc.alive()
    wrong = [d for d in seen if (d or {}).get("allocatedTo") != owner]
    assert seen and not wrong, wrong[:3]
    assert (restarted.resource(SIM) or {})["allocated"] == 1
    # OwnersCurrent kept its transition time across the restart (read back from the object), as the others do.
    assert published_condition(env.cluster, env.node, "OwnersCurrent") == current
