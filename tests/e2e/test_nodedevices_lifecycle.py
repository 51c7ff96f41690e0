"""The NodeDevices object's life against the real API server and real agent processes (found in review): an agent
started before its Node, the object's owner, and its conditions."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from deviceplane.agent.kube.client import KubeApi, api_client
from deviceplane.agent.kube.node_devices import NodeDevicesPublisher
from deviceplane.api.models import AgentView, DevicesStatus, PluginView, ResourceView
from deviceplane.core.conditions import ResourceCounts
from deviceplane.core.conditions import conditions as judged
from deviceplane.core.view import rfc3339

from .agent_cluster import api, bound_token, daemonset_pod, node_devices
from .cluster import Cluster
from .procs import wait_for

GPU = "example.com/gpu"
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
