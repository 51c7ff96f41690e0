"""Cluster-mode parts against a real API server, each in process: the Node status publisher (what it writes, when it
reads the Node back) and the pod parser on pods exactly as the API server stores them.

(The whole agent in a cluster: test_cluster_agent.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from deviceplane.agent.kube.client import KubeApi, api_client
from deviceplane.agent.kube.node_status import NodeStatusPublisher
from deviceplane.core.pods import Pod, parse_pod
from deviceplane.core.registry import Capacity

from .agent_cluster import api, node_status
from .cluster import Cluster

GPU = "example.com/gpu"
FPGA = "other.example/fpga"  # an extended resource someone else advertised on the Node
SIM = "example.com/sim"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
RESYNC = 0.5  # the publisher's read-back interval in these tests (60 s in the agent)


@pytest.fixture
def kube(cluster: Cluster) -> KubeApi:
    return KubeApi(api_client(cluster.kubeconfig))


def set_node_counts(cluster: Cluster, node: str, counts: dict[str, str]) -> None:
    """Write `counts` into the Node's capacity and allocatable, as another writer (or an earlier agent) would."""
    patch = {"status": {"capacity": counts, "allocatable": counts}}
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{node}/status", patch, None, STRATEGIC_MERGE_PATCH)
    assert code == 200, body


def run_publisher(publisher: NodeStatusPublisher, seconds: float, meanwhile: Callable[[], Awaitable[None]]) -> None:
    """Run the publisher's loop for `seconds`, with `meanwhile` running alongside; then cancel it."""

    async def main() -> None:
        task = asyncio.create_task(publisher.run())
        await asyncio.gather(meanwhile(), asyncio.sleep(seconds))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


async def nothing() -> None:
    return None


# -- Node status: stale extended resources on a recreated node --------------------------------------------------


def test_recreated_node_zeroes_every_extended_resource_once(cluster: Cluster, kube: KubeApi, kwok_nodes) -> None:
    """With no checkpoint at start (upstream ShouldResetExtendedResourceCapacity), the kubelet zeroes the capacity and
    allocatable of every extended resource already on the Node (kubelet_node_status.go reconcileExtendedResource),
    its own and anyone else's; native resources are left alone, and what the plugins have now is published."""
    (node,) = kwok_nodes(1, prefix="ns-reset")
    set_node_counts(cluster, node, {GPU: "4", FPGA: "2"})
    before = node_status(cluster, node)
    current = Capacity({SIM: 3}, {SIM: 2})

    publisher = NodeStatusPublisher(kube, node, lambda: current, resync=RESYNC, reset_extended_resources=True)
    run_publisher(publisher, 1.5, nothing)

    after = node_status(cluster, node)
    assert publisher.published and publisher.writes == 1  # the zeros went out with the first write
    assert (after["capacity"][GPU], after["allocatable"][GPU]) == ("0", "0")
    assert (after["capacity"][FPGA], after["allocatable"][FPGA]) == ("0", "0")
    assert (after["capacity"][SIM], after["allocatable"][SIM]) == ("3", "2")
    for field in ("capacity", "allocatable"):
        native = {k: v for k, v in before[field].items() if "/" not in k}
        assert native and {k: v for k, v in after[field].items() if "/" not in k} == native


def test_zeroing_is_once_only_and_only_when_asked(cluster: Cluster, kube: KubeApi, kwok_nodes) -> None:
    """Without a reset (a checkpoint was found), another writer's extended resource is left alone; with one, it is
    zeroed at start only: set again later, it is not fought over (the kubelet does not either)."""
    (node,) = kwok_nodes(1, prefix="ns-keep")
    set_node_counts(cluster, node, {FPGA: "2"})
    current = Capacity({SIM: 1}, {SIM: 1})

    kept = NodeStatusPublisher(kube, node, lambda: current, resync=RESYNC)
    run_publisher(kept, 1.0, nothing)
    assert node_status(cluster, node)["allocatable"][FPGA] == "2"

    reset = NodeStatusPublisher(kube, node, lambda: current, resync=RESYNC, reset_extended_resources=True)

    async def set_again_once_zeroed() -> None:
        for _ in range(100):
            if node_status(cluster, node)["allocatable"][FPGA] == "0":
                set_node_counts(cluster, node, {FPGA: "5"})
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{FPGA} never zeroed: {node_status(cluster, node)}")

    run_publisher(reset, 3.0, set_again_once_zeroed)  # several read-backs after the new value
    assert node_status(cluster, node)["allocatable"][FPGA] == "5"


# -- Node status: quantities as the API server stores them ---------------------------------------------------------


def test_count_of_1000_is_not_rewritten_every_resync(cluster: Cluster, kube: KubeApi, kwok_nodes) -> None:
    """The API server stores the quantity 1000 as "1k" (canonical form): the read-back must compare quantities, not
    strings, or it sees a difference and rewrites the Node at every resync."""
    (node,) = kwok_nodes(1, prefix="ns-1k")
    current = Capacity({GPU: 1000}, {GPU: 1000})
    publisher = NodeStatusPublisher(kube, node, lambda: current, resync=RESYNC)

    run_publisher(publisher, 8 * RESYNC, nothing)

    assert node_status(cluster, node)["capacity"][GPU] == "1k"  # what makes the string comparison fail
    assert publisher.writes == 1, f"{publisher.writes} writes of unchanged values"


def test_read_back_is_not_starved_by_device_events(cluster: Cluster, kube: KubeApi, kwok_nodes) -> None:
    """Device events that leave the counts unchanged (a device replaced, health swapped between two devices) can come
    more often than the resync interval: the read-back must still happen, so a manual edit is repaired."""
    (node,) = kwok_nodes(1, prefix="ns-starve")
    current = Capacity({GPU: 2}, {GPU: 2})
    publisher = NodeStatusPublisher(kube, node, lambda: current, resync=RESYNC)

    async def edit_then_keep_events_coming() -> None:
        for _ in range(200):
            if publisher.published:
                break
            await asyncio.sleep(0.05)
        set_node_counts(cluster, node, {GPU: "7"})
        for _ in range(int(8 * RESYNC / 0.1)):  # an event every 0.1 s for 8 resync intervals
            publisher.changed()
            await asyncio.sleep(0.1)

    run_publisher(publisher, 0.0, edit_then_keep_events_coming)

    assert node_status(cluster, node)["allocatable"][GPU] == "2"
    assert publisher.writes == 2  # the first publish and the repair


# -- pods as the API server stores them ----------------------------------------------------------------------------


def restart_policy_pod(namespace: str, name: str, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Always",
            "containers": [{"name": "app", "image": "x.invalid/a:1", "resources": {"limits": {GPU: "1"}}, **container}],
        },
    }


@pytest.mark.parametrize(
    "container",
    [
        {"restartPolicy": "Never"},
        {"restartPolicy": "OnFailure"},
        {"restartPolicy": "Always"},
        {
            "restartPolicy": "Never",
            "restartPolicyRules": [{"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}],
        },
    ],
    ids=["never", "on-failure", "always", "rules"],
)
def test_api_pod_with_container_restart_policy_gets_devices(
    cluster: Cluster, namespace: str, container: dict[str, Any]
) -> None:
    """v1.36 (ContainerRestartRules): a regular container may carry its own restartPolicy and restartPolicyRules.
    The API server accepts such a pod, so it must parse, as an app container (it does not change what the device
    manager allocates: only an init container with restartPolicy Always is a sidecar)."""
    code, body = api(
        cluster, "POST", f"/api/v1/namespaces/{namespace}/pods", restart_policy_pod(namespace, "rp", container)
    )
    assert code == 201, body
    stored = cluster.get_json("pod", "-n", namespace, "rp")
    assert stored["spec"]["containers"][0]["restartPolicy"] == container["restartPolicy"]

    pod = parse_pod(stored, "n")

    assert isinstance(pod, Pod)
    assert [(c.name, c.kind, c.limits) for c in pod.containers] == [("app", "app", ((GPU, 1),))]
