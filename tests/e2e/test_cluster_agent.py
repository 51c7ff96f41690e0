"""The agent in a cluster (real kube-apiserver, controller-manager, scheduler, kwok nodes; one agent process per
node), authenticated as its DaemonSet pod would be: a TokenRequest bound to the DaemonSet's pod on its node, with
nothing but the RBAC and ValidatingAdmissionPolicy of manifests/.

Figures (registration → Node capacity, health flip → allocatable/NodeDevices) are printed with `[figure]`."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

from deviceplane.core.pods import PodError, parse_quantity
from tests.support.pods import PodResourcesClient, listed_devices, simple_pod

from .agent_cluster import (
    AGENT_DEBOUNCE_SECONDS,
    AGENT_GRACE_SECONDS,
    NAMESPACE,
    Stopwatch,
    api,
    bound_token,
    daemonset_pod,
    node_devices,
    node_status,
    token_kubeconfig,
)
from .cluster import Cluster, http_json, http_ok
from .procs import wait_for

GPU = "example.com/gpu"
NULL = "squat.ai/null"
DEBOUNCE = AGENT_DEBOUNCE_SECONDS
GRACE = AGENT_GRACE_SECONDS
OUTAGE_SECONDS = 30.0


def without_nulls(value: Any) -> Any:
    """As the API server stores a merge patch: null fields are absent."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def resources_match(cluster: Cluster, node: str, agent: Any, limit: int | None = None) -> bool:
    """NodeDevices and the Node's status show exactly what the agent shows locally (`limit` devices a resource)."""
    published = node_devices(cluster, node)
    query = f"?limit={limit}" if limit is not None else ""
    local = without_nulls(http_json(f"{agent.url}/api/v1/devices{query}")["resources"])
    if published is None or (published.get("status") or {}).get("resources") != local:
        return False
    counts = node_status(cluster, node)
    return all(
        same_quantity(counts["capacity"].get(r["name"]), r["capacity"])
        and same_quantity(counts["allocatable"].get(r["name"]), r["allocatable"])
        for r in local
    )


def same_quantity(stored: str | None, count: int) -> bool:
    """The API server stores quantities in canonical form (1000 as "1k"): compare numbers, not strings."""
    try:
        return parse_quantity(stored, "node status") == count
    except PodError:
        return False


def test_node_status_and_nodedevices_follow_the_plugin(agent_installed: Cluster, node_agent, test_plugins) -> None:
    cluster = agent_installed
    node, agent = node_agent(extra=["--nodedevices-max-devices", "2"])
    before = node_status(cluster, node)
    plugin = test_plugins(
        agent.plugin_dir, "gpu.sock", [["g0", "Healthy", [0]], ["g1", "Healthy", [1]], ["g2", "Healthy", [1]]]
    )
    clock = Stopwatch()
    clock.start()
    plugin.register(GPU)
    clock.until(
        "plugin registered -> Node capacity/allocatable",
        lambda: node_status(cluster, node)["allocatable"].get(GPU) == "3",
        procs=[agent.proc],
    )
    after = node_status(cluster, node)
    assert after["capacity"][GPU] == "3"
    # Every other resource is left alone.
    for field in ("capacity", "allocatable"):
        assert {k: v for k, v in after[field].items() if k != GPU} == before[field]

    wait_for(
        "NodeDevices to match the agent", lambda: resources_match(cluster, node, agent, limit=2), procs=[agent.proc]
    )
    obj = node_devices(cluster, node)
    assert obj is not None
    # The device list is bounded (--nodedevices-max-devices 2), the counts are exact.
    (resource,) = obj["status"]["resources"]
    assert [d["id"] for d in resource["devices"]] == ["g0", "g1"] and resource["devicesTruncated"] is True
    assert (resource["capacity"], resource["healthy"], obj["status"]["deviceCount"]) == (3, 3, 3)
    node_uid = cluster.get_json("node", node)["metadata"]["uid"]
    assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]
    assert obj["spec"] == {"nodeName": node}
    assert obj["status"]["agent"]["node"] == node
    table = cluster.kubectl("get", "nodedevices", node).splitlines()
    assert table[0].split() == ["NAME", "RESOURCES", "DEVICES", "HEALTHY", "ALLOCATED", "HEARTBEAT", "AGE"], table
    assert table[1].split()[:5] == [node, "1", "3", "3", "0"], table
    assert re.fullmatch(r"\d+s", table[1].split()[5]), table  # the heartbeat's age: a stopped agent shows
    wide = cluster.kubectl("get", "nodedevices", node, "-o", "wide").splitlines()
    assert wide[0].split()[-4:] == ["PLUGINS", "DEVICES-HEALTHY", "OWNERS-CURRENT", "AGE"], wide
    assert wide[1].split()[-3:-1] == ["True", "True"], wide
    owners = wide[0].index("OWNERS-CURRENT")
    assert wide[1][owners : owners + len("OWNERS-CURRENT")].strip() == "", wide  # proxy mode's condition: blank here

    # A health flip reaches allocatable and NodeDevices within the debounce interval + 1 s.
    clock.start()
    plugin.devices([["g0", "Healthy", [0]], ["g1", "Unhealthy", [1]], ["g2", "Healthy", [1]]])
    clock.until(
        "health flip -> Node allocatable",
        lambda: node_status(cluster, node)["allocatable"].get(GPU) == "2",
        procs=[agent.proc],
    )
    clock.until(
        "health flip -> NodeDevices",
        lambda: (node_devices(cluster, node) or {}).get("status", {}).get("healthyCount") == 2,
        procs=[agent.proc],
    )
    as_yaml = cluster.kubectl("get", "nodedevices", node, "-o", "yaml")
    assert "devicesTruncated: true" in as_yaml
    for text in ("id: g1", "health: Unhealthy", "numaNodes:"):
        assert text in as_yaml, as_yaml
    explained = cluster.kubectl("explain", "nodedevices.status.resources.devices")
    for field in ("allocatedTo", "health", "numaNodes"):
        assert field in explained, explained
    assert "DESCRIPTION" in cluster.kubectl("explain", "nodedevices.status")

    # The plugin goes away: capacity stays during the grace period (allocatable 0), then both are 0, as the kubelet.
    plugin.stop()
    wait_for(
        "allocatable 0 while the plugin is away",
        lambda: node_status(cluster, node)["allocatable"].get(GPU) == "0",
        procs=[agent.proc],
    )
    clock.start()
    clock.until(
        "plugin gone past the grace period -> capacity 0",
        lambda: node_status(cluster, node)["capacity"].get(GPU) == "0",
        timeout=GRACE + 30,
        procs=[agent.proc],
    )
    wait_for(
        "NodeDevices without the resource",
        lambda: (node_devices(cluster, node) or {}).get("status", {}).get("resources") == [],
        procs=[agent.proc],
    )

    # Deleting the Node garbage-collects its NodeDevices (ownerReference).
    cluster.kubectl("delete", "node", node, "--wait=false")
    wait_for("NodeDevices collected with its Node", lambda: node_devices(cluster, node) is None, timeout=60)
    assert agent.proc.alive()


def test_agent_without_checkpoint_zeroes_stale_extended_resources(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, procs, short_tmp
) -> None:
    """The Node still advertises GPUs an earlier agent published; the agent starts with an empty plugin dir (no
    checkpoint: the node was re-imaged) and the GPUs' plugin never comes back. As the kubelet does in that case
    (ShouldResetExtendedResourceCapacity, spec §4.6), every extended resource on the Node is zeroed, so the
    scheduler stops sending GPU pods the agent would refuse. Restarted on the same plugin dir (a checkpoint is there
    now), the agent leaves the Node's extended resources alone."""
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="reset")
    kubeconfig = token_kubeconfig(
        cluster, bound_token(cluster, daemonset_pod(cluster, node)), short_tmp("dp-kc") / "agent.kubeconfig"
    )
    stale = {"status": {"capacity": {GPU: "4"}, "allocatable": {GPU: "4"}}}
    smp = "application/strategic-merge-patch+json"
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{node}/status", stale, None, smp)
    assert code == 200, body
    native = {k: v for k, v in node_status(cluster, node)["capacity"].items() if "/" not in k}

    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=node, extra=["--grace-period", f"{GRACE:g}s"])

    # Ready means the first Node status write succeeded: the zeroing is part of it.
    counts = node_status(cluster, node)
    assert (counts["capacity"].get(GPU), counts["allocatable"].get(GPU)) == ("0", "0"), counts
    assert {k: v for k, v in counts["capacity"].items() if "/" not in k} == native

    procs.stop(agent.proc)
    assert (agent.plugin_dir / "kubelet_internal_checkpoint").exists()
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{node}/status", stale, None, smp)
    assert code == 200, body
    deviceplane_agent(
        kubeconfig=kubeconfig, node_name=node, plugin_dir=agent.plugin_dir, extra=["--grace-period", f"{GRACE:g}s"]
    )
    time.sleep(GRACE + 1.0)  # past the grace period: nothing would be zeroed later either
    assert node_status(cluster, node)["allocatable"].get(GPU) == "4"


def test_api_pods_generic_device_plugin_events_and_release(
    agent_installed: Cluster, node_agent, generic_device_plugin, namespace: str
) -> None:
    """generic-device-plugin (real, Go) on an agent-run node: its devices reach the Node and NodeDevices, a pod
    created with kubectl is admitted with the plugin's device specs, an over-asking pod gets the kubelet's Warning
    Event, and deleting the pod frees its devices."""
    cluster = agent_installed
    node, agent = node_agent()
    plugin = generic_device_plugin(agent.plugin_dir)
    procs = [agent.proc, plugin]
    wait_for(
        "squat.ai/null on the Node", lambda: node_status(cluster, node)["allocatable"].get(NULL) == "4", procs=procs
    )
    wait_for("NodeDevices to match the agent", lambda: resources_match(cluster, node, agent), procs=procs)

    def pod(name: str, count: int, **spec: Any) -> dict[str, Any]:
        limits = {"limits": {NULL: str(count)}}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1", "resources": limits}], **spec},
        }

    # Scheduled by the real scheduler, from the allocatable the agent published. (The API server taints new nodes
    # not-ready and only the node-lifecycle controller, not run here, would lift it.)
    tolerate = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule"}]
    cluster.apply(pod("user", 2, nodeSelector={"kubernetes.io/hostname": node}, tolerations=tolerate))

    def admitted() -> dict[str, Any] | None:
        found = [p for p in agent.pods() if p["name"] == "user" and p["namespace"] == namespace]
        return found[0] if found and found[0]["admitted"] else None

    wait_for("the kubectl-created pod admitted by the agent", lambda: admitted() is not None, procs=procs, timeout=60)
    entry = admitted()
    assert entry is not None and entry["source"] == f"api:{namespace}/user"
    (app,) = entry["containers"]
    held = set(app["devices"][NULL])
    assert len(held) == 2
    # The plugin's own Allocate answer: a device spec for /dev/null.
    assert [d["hostPath"] for d in app["runOptions"]["devices"]] == ["/dev/null"], app["runOptions"]
    client = PodResourcesClient(agent.pod_resources_socket)
    try:
        assert listed_devices(client.list())[(namespace, "user", "app")] == {NULL: held}
    finally:
        client.close()

    def owners() -> dict[str, Any]:
        status = (node_devices(cluster, node) or {}).get("status") or {}
        return {
            d["id"]: d.get("allocatedTo")
            for r in status.get("resources", [])
            if r["name"] == NULL
            for d in r["devices"]
        }

    want = {"namespace": namespace, "pod": "user", "container": "app"}
    wait_for(
        "NodeDevices to show the pod's devices",
        lambda: {k for k, v in owners().items() if v == want} == held,
        procs=procs,
    )

    as_yaml = cluster.kubectl("get", "nodedevices", node, "-o", "yaml")
    assert "allocatedTo:" in as_yaml and "pod: user" in as_yaml and f"namespace: {namespace}" in as_yaml, as_yaml

    # Bound to the node directly (the scheduler would not place it): the agent refuses it as the kubelet would.
    cluster.apply(pod("greedy", 3, nodeName=node))
    message = (
        f"Allocate failed due to requested number of devices unavailable for {NULL}. Requested: 3, Available: 2, "
        "which is unexpected"
    )

    def warning() -> bool:
        events = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=greedy")["items"]
        return any(
            e["type"] == "Warning" and e["reason"] == "UnexpectedAdmissionError" and e["message"] == message
            for e in events
        )

    wait_for("a Warning Event on the over-asking pod", warning, procs=procs, timeout=60)
    assert sorted(v is None for v in owners().values()) == [False, False, True, True]  # the refused pod took none

    cluster.kubectl("delete", "pod", "-n", namespace, "user", "--wait=false")
    wait_for("the deleted pod's devices freed", lambda: (agent.resource(NULL) or {}).get("allocated") == 0, procs=procs)
    wait_for("NodeDevices without owners", lambda: not any(owners().values()), procs=procs)


def test_bound_token_writes_only_its_own_node(agent_installed: Cluster, kwok_nodes) -> None:
    cluster = agent_installed
    own, other = kwok_nodes(2, prefix="policy")
    token = bound_token(cluster, daemonset_pod(cluster, own))
    smp = "application/strategic-merge-patch+json"
    merge = "application/merge-patch+json"
    extended = {"status": {"capacity": {GPU: "1"}, "allocatable": {GPU: "1"}}}
    prefix = "ValidatingAdmissionPolicy 'deviceplane-agent-node-scoped' with binding 'deviceplane-agent-node-scoped'"

    # Its own node: extended resources yes, anything else no.
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{own}/status", extended, token, smp)
    assert code == 200, body
    code, body = api(
        cluster, "PATCH", f"/api/v1/nodes/{own}/status", {"status": {"capacity": {"cpu": "1"}}}, token, smp
    )
    assert code == 403 and "may change only extended resources" in body["message"], body

    # Another node: refused, with the policy's message.
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{other}/status", extended, token, smp)
    assert code == 403, body
    assert (
        f"{prefix} denied request: deviceplane-agent on node {own} may write only the objects of that node, "
        f"not nodes/status {other}" in body["message"]
    ), body
    group = "/apis/deviceplane.io/v1alpha1/nodedevices"
    for node in (own, other):
        obj = {
            "apiVersion": "deviceplane.io/v1alpha1",
            "kind": "NodeDevices",
            "metadata": {"name": node},
            "spec": {"nodeName": node},
        }
        code, body = api(cluster, "POST", group, obj, token)
        if node == own:
            assert code == 201, body
        else:
            assert code == 403, body
            assert f"may write only the objects of that node, not nodedevices {other}" in body["message"], body
    # NodeDevices/<other> written by someone allowed to: the agent still may not touch its status.
    cluster.apply(
        {
            "apiVersion": "deviceplane.io/v1alpha1",
            "kind": "NodeDevices",
            "metadata": {"name": other},
            "spec": {"nodeName": other},
        }
    )
    status = {
        "status": {
            "resources": [],
            "agent": {"version": "x", "node": other, "lastHeartbeatTime": "2026-01-01T00:00:00Z"},
        }
    }
    code, body = api(cluster, "PATCH", f"{group}/{other}/status", status, token, merge)
    assert code == 403 and f"not nodedevices/status {other}" in body["message"], body
    code, body = api(
        cluster,
        "PATCH",
        f"{group}/{own}/status",
        {**status, "status": {**status["status"], "agent": {**status["status"]["agent"], "node": own}}},
        token,
        merge,
    )
    assert code == 200, body

    # A token that names no node (not bound to a pod) is refused outright.
    unbound = cluster.kubectl("create", "token", "deviceplane-agent", "-n", NAMESPACE).strip()
    code, body = api(cluster, "PATCH", f"/api/v1/nodes/{own}/status", extended, unbound, smp)
    assert code == 403 and "the token names no node" in body["message"], body
    # RBAC is least privilege: no deleting nodes, no reading secrets.
    code, _ = api(cluster, "DELETE", f"/api/v1/nodes/{own}", None, token)
    assert code == 403
    code, _ = api(cluster, "GET", "/api/v1/secrets", None, token)
    assert code == 403


def test_api_server_outage(agent_installed: Cluster, node_agent, test_plugins, short_tmp) -> None:
    """The API server is stopped (SIGSTOP: connections hang, the worst case) for 30 s while static pods come and
    go: the agent stays up and keeps admitting, then converges with no lost update."""
    cluster = agent_installed
    manifests = short_tmp("dp-manifests")
    node, agent = node_agent(pod_manifest_dir=manifests)
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [[f"g{i}", "Healthy"] for i in range(4)])
    plugin.register(GPU)
    wait_for("published before the outage", lambda: resources_match(cluster, node, agent), procs=[agent.proc])

    apiserver = next(p for p in cluster.started if p.name == "kube-apiserver")
    apiserver.popen.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        simple_pod(manifests, "first", GPU, 1)
        simple_pod(manifests, "second", GPU, 2)
        wait_for(
            "static pods admitted during the outage",
            lambda: (agent.resource(GPU) or {}).get("allocated") == 3,
            procs=[agent.proc],
        )
        (manifests / "first.json").unlink()
        plugin.devices([["g0", "Healthy"], ["g1", "Healthy"], ["g2", "Healthy"], ["g3", "Unhealthy"]])
        wait_for(
            "release and health seen locally",
            lambda: (agent.resource(GPU) or {}).get("allocated") == 2 and agent.resource(GPU)["healthy"] == 3,
            procs=[agent.proc],
        )
        simple_pod(manifests, "third", GPU, 1)
        wait_for("admitting goes on", lambda: (agent.resource(GPU) or {}).get("allocated") == 3, procs=[agent.proc])
        pods = {p["name"]: p for p in agent.pods()}
        assert pods["third"]["admitted"] and pods["second"]["admitted"] and "first" not in pods
        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - stopped)))
        assert agent.proc.alive() and http_ok(agent.url + "/healthz")
    finally:
        apiserver.popen.send_signal(signal.SIGCONT)
    clock = Stopwatch()
    clock.start()
    clock.until(
        "API server back -> NodeDevices and Node status converged",
        lambda: resources_match(cluster, node, agent),
        timeout=90,
        procs=[agent.proc],
    )
    published = node_devices(cluster, node)
    assert published is not None
    owners = sorted(
        (d.get("allocatedTo") or {}).get("pod", "") for r in published["status"]["resources"] for d in r["devices"]
    )
    assert owners == ["", "second", "second", "third"], owners
