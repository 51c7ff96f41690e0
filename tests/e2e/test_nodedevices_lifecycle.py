"""The NodeDevices object's life against the real API server and real agent processes (found in review): an agent
started before its Node, the object's owner, and its conditions."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deviceplane.agent.kube.client import KubeApi, api_client
from deviceplane.agent.kube.node_devices import NodeDevicesPublisher
from deviceplane.api.models import AgentView, DevicesStatus, PluginView, ResourceView
from deviceplane.core.conditions import ResourceCounts
from deviceplane.core.conditions import conditions as judged
from deviceplane.core.times import rfc3339
from tests.support.pods import simple_pod

from .agent_cluster import api, bound_token, daemonset_pod, node_devices, token_kubeconfig
from .cluster import REPO, Cluster
from .procs import Proc, Procs, wait_for

GPU = "example.com/gpu"
NIC = "example.com/nic"
ND = "/apis/deviceplane.io/v1alpha1/nodedevices"


def now() -> str:
    return rfc3339(time.time())


def conditions(cluster: Cluster, node: str) -> dict[str, dict[str, Any]]:
    found = ((node_devices(cluster, node) or {}).get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in found}


def test_an_agent_started_before_its_node_publishes_soon_after_the_node_appears(
    agent_installed: Cluster, deviceplane_agent
) -> None:
    """A kubelet-less node's agent may start before whatever registers the Node: once the Node exists, its capacity
    and NodeDevices (owned by it) must follow within seconds, not after a backoff grown to 30 s while it was away.
    (Admin credentials: the node-scoped token needs a pod on an existing node; the policy is not the subject here.)"""
    cluster = agent_installed
    node = f"nd-late-{os.urandom(3).hex()}"
    created_at: list[float] = []

    def create_node_later() -> None:
        time.sleep(20)  # the agent's retries have backed off to several seconds by now
        cluster.create_node(node)
        created_at.append(time.monotonic())

    creator = threading.Thread(target=create_node_later, daemon=True)
    creator.start()
    try:
        deviceplane_agent(kubeconfig=cluster.kubeconfig, node_name=node, extra=["--nodedevices-debounce", "1s"])
        ready = time.monotonic()
        creator.join()
        obj = node_devices(cluster, node)
        assert obj is not None
        uid = cluster.get_json("node", node)["metadata"]["uid"]
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid]
        print(f"[figure] Node created -> agent ready (Node status + NodeDevices): {ready - created_at[0]:.2f} s")
        assert ready - created_at[0] < 5.0
    finally:
        creator.join()
        cluster.kubectl("delete", "node", node, "--wait=false", "--ignore-not-found", check=False)


def test_an_owner_reference_removed_by_hand_is_restored(agent_installed: Cluster, node_agent, test_plugins) -> None:
    """Without its ownerReference the object outlives its Node: `kubectl get nodedevices` lists a deleted node."""
    cluster = agent_installed
    node, agent = node_agent()
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"]])
    plugin.register(GPU)
    wait_for("published", lambda: node_devices(cluster, node) is not None, procs=[agent.proc])
    status, out = api(
        cluster, "PATCH", f"{ND}/{node}", {"metadata": {"ownerReferences": None}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    assert status == 200, out
    plugin.devices([["g0", "Unhealthy"]])  # a write, so the agent looks at the object
    owners = lambda: (node_devices(cluster, node) or {}).get("metadata", {}).get("ownerReferences")  # noqa: E731
    wait_for("the ownerReference restored", lambda: bool(owners()), timeout=15, procs=[agent.proc])
    uid = cluster.get_json("node", node)["metadata"]["uid"]
    assert owners() == [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]


def test_the_agents_token_may_patch_only_its_own_nodes_object(agent_installed: Cluster, kwok_nodes) -> None:
    """`patch` on nodedevices (to restore the ownerReference) stays node-scoped: the policy lets the agent's pod-bound
    token patch its own node's object, not another node's."""
    cluster = agent_installed
    own, other = kwok_nodes(2, prefix="nd-patch")
    token = bound_token(cluster, daemonset_pod(cluster, own))
    owner = {}
    for node in (own, other):
        uid = cluster.get_json("node", node)["metadata"]["uid"]
        owner[node] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]
        cluster.apply(
            {
                "apiVersion": "deviceplane.io/v1alpha1",
                "kind": "NodeDevices",
                "metadata": {"name": node, "ownerReferences": owner[node]},
                "spec": {"nodeName": node},
            }
        )
    merge = "application/merge-patch+json"
    code, body = api(cluster, "PATCH", f"{ND}/{own}", {"metadata": {"ownerReferences": owner[own]}}, token, merge)
    assert code == 200, body
    code, body = api(cluster, "PATCH", f"{ND}/{other}", {"metadata": {"ownerReferences": None}}, token, merge)
    assert code == 403 and f"may write only the objects of that node, not nodedevices {other}" in body["message"], body
    assert (node_devices(cluster, other) or {})["metadata"]["ownerReferences"] == owner[other]


def test_conditions_say_whether_plugins_are_up_and_devices_healthy(
    agent_installed: Cluster, node_agent, test_plugins
) -> None:
    """`kubectl wait nodedevices/<node> --for=condition=DevicesHealthy=false` must work: the conditions carry the
    state, with the resources concerned in the message, and lastTransitionTime moves only on a transition."""
    cluster = agent_installed
    node, agent = node_agent()
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
    plugin.register(GPU)
    wait_for(
        "conditions all True",
        lambda: (
            {t: c["status"] for t, c in conditions(cluster, node).items()}
            == {"PluginsConnected": "True", "DevicesHealthy": "True"}
        ),
        timeout=15,
        procs=[agent.proc],
    )
    connected_since = conditions(cluster, node)["PluginsConnected"]["lastTransitionTime"]

    plugin.devices([["g0", "Healthy"], ["g1", "Unhealthy"]])
    out = cluster.kubectl("wait", f"nodedevices/{node}", "--for=condition=DevicesHealthy=false", "--timeout=15s")
    assert "condition met" in out
    unhealthy = conditions(cluster, node)["DevicesHealthy"]
    assert (unhealthy["reason"], unhealthy["message"]) == ("UnhealthyDevices", f"{GPU}: 1 of 2 unhealthy")
    assert conditions(cluster, node)["PluginsConnected"]["lastTransitionTime"] == connected_since

    plugin.stop()
    cluster.kubectl("wait", f"nodedevices/{node}", "--for=condition=PluginsConnected=false", "--timeout=15s")
    gone = conditions(cluster, node)["PluginsConnected"]
    assert (gone["reason"], gone["message"]) == ("PluginDisconnected", f"not connected: {GPU}")


def test_an_object_deleted_by_hand_is_created_again_at_the_next_write(agent_installed: Cluster, kwok_nodes) -> None:
    """In process, with a 1 s heartbeat (60 s in the agent, which bounds how long a deleted object stays away: the
    agent may only get and create the object, it cannot watch it). Conditions keep their transition times, also
    across a restart of the agent."""
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="nd-deleted")
    kube = KubeApi(api_client(cluster.kubeconfig))
    gpu = ResourceView(
        name=GPU, capacity=1, allocatable=1, healthy=1, unhealthy=0, allocated=0, devices=[],
        plugin=PluginView(connected=True, preStartRequired=False, getPreferredAllocationAvailable=False),
    )  # fmt: skip
    counts = ResourceCounts(GPU, connected=True, capacity=1, healthy=1, unhealthy=0)

    def status(_limit: int) -> DevicesStatus:
        # Judged afresh at each call (the agent's view keeps times while it runs): the publisher keeps the times.
        beat = now()
        agent = AgentView(version="t", node=node, lastHeartbeatTime=beat)
        return DevicesStatus(resources=[gpu], agent=agent, conditions=judged([counts], beat, {}))

    publisher = NodeDevicesPublisher(kube, node, status, heartbeat=1)

    async def delete_once_published() -> None:
        for _ in range(300):
            if publisher.published:
                break
            await asyncio.sleep(0.05)
        since = conditions(cluster, node)["DevicesHealthy"]["lastTransitionTime"]
        status, out = api(cluster, "DELETE", f"{ND}/{node}")
        assert status == 200, out
        for _ in range(60):
            await asyncio.sleep(0.1)
            if node_devices(cluster, node) is not None and conditions(cluster, node):
                assert conditions(cluster, node)["DevicesHealthy"]["lastTransitionTime"] == since
                return
        raise AssertionError("NodeDevices not created again")

    async def main() -> None:
        task = asyncio.create_task(publisher.run())
        try:
            await asyncio.wait_for(delete_once_published(), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())

    since = conditions(cluster, node)["DevicesHealthy"]["lastTransitionTime"]
    time.sleep(1.1)  # a later second: a restarted agent that forgot the times would write this one
    restarted = NodeDevicesPublisher(kube, node, status, heartbeat=1)

    async def restart() -> None:
        task = asyncio.create_task(restarted.run())
        for _ in range(100):
            await asyncio.sleep(0.05)
            if restarted.published:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(restart())
    assert restarted.published
    assert conditions(cluster, node)["DevicesHealthy"]["lastTransitionTime"] == since


# -- an agent restart, watched ---------------------------------------------------------------------------------------


class Writes:
    """Every change of one NodeDevices object after `resource_version`, as a watch sees it (admin credentials), read
    by a thread: what each write said, not only what is left at the end."""

    def __init__(self, cluster: Cluster, node: str, resource_version: str) -> None:
        server = urllib.parse.urlsplit(cluster.server)
        query = urllib.parse.urlencode(
            {"watch": "1", "fieldSelector": f"metadata.name={node}", "resourceVersion": resource_version}
        )
        self.seen: list[tuple[float, dict[str, Any]]] = []  # (monotonic time received, the object written)
        self._conn = http.client.HTTPSConnection(server.hostname, server.port, context=cluster.admin_ssl, timeout=120)
        self._conn.request("GET", f"{ND}?{query}")
        self._response = self._conn.getresponse()
        assert self._response.status == 200, self._response.read()
        self._thread = threading.Thread(target=self._read, name="nodedevices watch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):  # ended by `stop`
            for line in self._response:
                event = json.loads(line)
                if event["type"] in ("ADDED", "MODIFIED"):
                    self.seen.append((time.monotonic(), event["object"]))

    def stop(self) -> list[tuple[float, dict[str, Any]]]:
        if self._conn.sock is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        self._thread.join(10)
        self._conn.close()
        return list(self.seen)


def start_sim(procs: Procs, plugin_dir: Path, resource: str, count: int) -> tuple[Proc, str]:
    """Our sim plugin (re-registers by itself when the agent's kubelet.sock comes back); the process and its control
    URL."""
    argv = [
        sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", resource, "--count", str(count),
        "--numa", "0", "--plugin-dir", str(plugin_dir), "--control", "127.0.0.1:0",
    ]  # fmt: skip
    proc = procs.start("deviceplane-plugin-sim", argv, cwd=REPO)
    url: list[str] = []

    def printed() -> bool:
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.startswith("control: "):
                url.append(line.removeprefix("control: ").strip())
                return True
        return False

    wait_for("sim control address", printed, procs=[proc], timeout=30)
    return proc, url[0]


def summary(obj: dict[str, Any]) -> dict[str, Any]:
    """What a NodeDevices write says about the devices: counts per resource, plugin connected, the conditions (times
    included); not the heartbeat nor the plugin's registration time."""
    status = obj.get("status") or {}
    counts = ("capacity", "allocatable", "healthy", "unhealthy", "allocated")
    return {
        "resources": {
            r["name"]: {**{k: r[k] for k in counts}, "connected": r["plugin"]["connected"]}
            for r in status.get("resources") or []
        },
        "totals": {k: status.get(k) for k in ("deviceCount", "healthyCount", "allocatedCount")},
        "conditions": {c["type"]: c for c in status.get("conditions") or []},
    }


def registered_at(obj: dict[str, Any] | None) -> dict[str, str | None]:
    return {r["name"]: r["plugin"].get("registeredAt") for r in ((obj or {}).get("status") or {}).get("resources", [])}


def test_an_agent_restart_publishes_nothing_false_while_the_plugins_come_back(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, procs: Procs, short_tmp
) -> None:
    """A restarted agent restores its resources from the checkpoint with 0 devices until their plugins register again
    and list their devices (about a second). NodeDevices written from that window said every device was gone
    (allocatedCount 2 beside deviceCount 0), DevicesHealthy True on a node with unhealthy devices and PluginsConnected
    False, each with a new lastTransitionTime, then the truth a second later: every DaemonSet rollout flipped both.
    No write between the restart and the plugins' return may say so. A restored resource whose plugin does not come
    back is published, as disconnected, once the startup plugin wait is over, and not before."""
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="nd-restart")
    token = bound_token(cluster, daemonset_pod(cluster, node))
    kubeconfig = token_kubeconfig(cluster, token, short_tmp("dp-kc") / "agent.kubeconfig")
    plugin_dir, manifests = short_tmp("dp-plugins"), short_tmp("dp-manifests")

    def start_agent(*flags: str) -> Any:
        extra = ["--nodedevices-debounce", "1s", "--grace-period", "60s", *flags]
        return deviceplane_agent(
            kubeconfig=kubeconfig, node_name=node, plugin_dir=plugin_dir, pod_manifest_dir=manifests, extra=extra
        )

    agent = start_agent()
    gpus, gpu_control = start_sim(procs, plugin_dir, GPU, 8)
    nics, _ = start_sim(procs, plugin_dir, NIC, 4)
    request = urllib.request.Request(
        gpu_control + "/health", json.dumps({"sim-6": False, "sim-7": False}).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        assert answer.status == 200
    simple_pod(manifests, "holder", GPU, 2)
    watched = [agent.proc, gpus, nics]

    def published(check: Callable[[dict[str, Any]], bool]) -> Callable[[], bool]:
        return lambda: check(summary(node_devices(cluster, node) or {}))

    wait_for(
        "2 of 8 GPUs unhealthy, 2 held, 4 NICs, published",
        published(
            lambda s: (
                s["totals"] == {"deviceCount": 12, "healthyCount": 10, "allocatedCount": 2}
                and {t: c["status"] for t, c in s["conditions"].items()}
                == {"PluginsConnected": "True", "DevicesHealthy": "False"}
            )
        ),
        timeout=30,
        procs=watched,
    )
    before = node_devices(cluster, node)
    assert before is not None
    time.sleep(1.1)  # a later second: a write that moved a transition time would show it

    # The restart: every plugin comes back by itself.
    writes = Writes(cluster, node, before["metadata"]["resourceVersion"])
    procs.stop(agent.proc)
    agent = start_agent()
    wait_for(
        "both plugins registered again, published",
        lambda: all(registered_at(node_devices(cluster, node))[r] != registered_at(before)[r] for r in (GPU, NIC)),
        timeout=30,
        procs=[agent.proc, gpus, nics],
    )
    time.sleep(2.5)  # two debounce intervals: any write still coming
    seen = writes.stop()
    assert any(registered_at(obj) != registered_at(before) for _, obj in seen), "the restarted agent wrote nothing"
    for _, obj in seen:
        assert summary(obj) == summary(before), obj["status"]

    # The restart without the NIC plugin: published once the startup wait (5 s) is over, with the NICs disconnected;
    # until then nothing, and the GPUs as they were all along.
    after = node_devices(cluster, node)
    assert after is not None
    writes = Writes(cluster, node, after["metadata"]["resourceVersion"])
    procs.stop(agent.proc)
    procs.stop(nics)
    restarted = time.monotonic()
    agent = start_agent("--startup-plugin-wait", "5s")
    wait_for(
        "the NICs published as disconnected",
        published(lambda s: s["resources"].get(NIC, {}).get("connected") is False),
        timeout=30,
        procs=[agent.proc, gpus],
    )
    seen = writes.stop()
    assert seen, "the restarted agent wrote nothing"
    assert seen[0][0] - restarted >= 5.0, f"published {seen[0][0] - restarted:.2f} s after the restart"
    expected = summary(before)
    for _, obj in seen:
        written = summary(obj)
        assert written["resources"][GPU] == expected["resources"][GPU], obj["status"]
        assert written["resources"][NIC] == {
            "capacity": 0, "allocatable": 0, "healthy": 0, "unhealthy": 0, "allocated": 0, "connected": False
        }, obj["status"]  # fmt: skip
        assert written["conditions"]["DevicesHealthy"] == expected["conditions"]["DevicesHealthy"]
        connected = written["conditions"]["PluginsConnected"]
        assert (connected["status"], connected["message"]) == ("False", f"not connected: {NIC}")
