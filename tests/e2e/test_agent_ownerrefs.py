"""The node agent on a kube-apiserver with the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift
and in hardened clusters; off in the package's shared control plane). The plugin
(kubernetes plugin/pkg/admission/gc/gc_admission.go) lets a create set any ownerReference, but an update that
changes one needs `delete` on the object: without it in the agent's RBAC, restoring NodeDevices' hand-removed
ownerReference to its Node was refused (403 "cannot set an ownerRef on a resource you can't delete") and the object
outlived its Node. The policy narrows that `delete` to the agent's own node's object; the agent never sends one.
(blockOwnerDeletion, which would need `update` on nodes/finalizers, is not set: the stored reference is checked.)

A control plane of its own for this module (the `cluster` fixture, overridden here; ~10 s to start), the shipped
manifests, and agents authenticated with a token bound to the DaemonSet's pod on their kwok node.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .agent_cluster import NAMESPACE, SERVICE_ACCOUNT, api, bound_token, daemonset_pod, node_devices
from .cluster import ENFORCE_OWNER_REFERENCES, Cluster, serve_cluster
from .procs import Procs, wait_for
from .test_proxy import start_sim

ND = "/apis/deviceplane.io/v1alpha1/nodedevices"
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
MERGE = "application/merge-patch+json"


@pytest.fixture(scope="module")
def cluster(k8s_bin: Path, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("cluster-agent-ownerrefs")
    yield from serve_cluster(k8s_bin, directory, procs, (ENFORCE_OWNER_REFERENCES,))


def owners(cluster: Cluster, node: str) -> list[dict[str, str]]:
    return list(((node_devices(cluster, node) or {}).get("metadata") or {}).get("ownerReferences") or [])


def test_the_agent_creates_its_nodedevices_owned_by_its_node_and_restores_a_removed_owner_reference(
    agent_installed: Cluster, node_agent, procs: Procs
) -> None:
    cluster = agent_installed
    assert "OwnerReferencesPermissionEnforcement" in " ".join(cluster.started[1].argv)
    node, agent = node_agent()  # ready: its first NodeDevices write (a create with the ownerReference) succeeded
    sim, control = start_sim(procs, agent.plugin_dir, count=2)
    try:
        uid = cluster.get_json("node", node)["metadata"]["uid"]
        ref = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}  # no blockOwnerDeletion
        wait_for("NodeDevices owned by its Node", lambda: owners(cluster, node) == [ref], procs=[agent.proc])
        wait_for("the sim's devices published",
                 lambda: [r["name"] for r in (node_devices(cluster, node) or {}).get("status", {}).get("resources", [])]
                 == ["example.com/sim"], procs=[agent.proc, sim])  # fmt: skip

        code, body = api(cluster, "PATCH", f"{ND}/{node}", {"metadata": {"ownerReferences": None}}, None, MERGE)
        assert code == 200 and not body["metadata"].get("ownerReferences"), body
        # A status write, at which the agent checks the object it gets back (else the 60 s heartbeat).
        with urllib.request.urlopen(
            urllib.request.Request(f"{control}/devices/sim-0/unhealthy", method="POST"), timeout=5
        ) as answer:
            assert answer.status == 200
        wait_for("the agent to restore the ownerReference", lambda: owners(cluster, node) == [ref], timeout=15,
                 procs=[agent.proc, sim])  # fmt: skip
    finally:
        procs.stop(sim)
    # This agent's requests (the user is the ServiceAccount's, shared by every node: its node is in the extra).
    sent = [
        e for e in cluster.audit_events()
        if e.get("user", {}).get("username") == AGENT_USER
        and e["user"].get("extra", {}).get("authentication.kubernetes.io/node-name") == [node]
    ]  # fmt: skip
    assert sent, "no audited request of the agent: the filter is broken"
    deletes = [e["objectRef"] for e in sent if e["verb"] == "delete"]
    assert deletes == [], f"the RBAC's delete is for the admission check only, yet the agent sent: {deletes}"
    restored = [
        e for e in sent
        if e["verb"] == "patch" and e["objectRef"].get("resource") == "nodedevices"
        and not e["objectRef"].get("subresource")
    ]  # fmt: skip
    codes = [e["responseStatus"]["code"] for e in restored]
    assert codes[-1:] == [200] and 403 not in codes, restored


def test_the_agents_delete_is_narrowed_to_its_own_nodes_object(agent_installed: Cluster, kwok_nodes) -> None:
    """`delete` on nodedevices is in the RBAC for the admission plugin only: the policy refuses the agent's identity
    the DELETE of another node's NodeDevices, as it refuses any other write of it."""
    cluster = agent_installed
    own, other = kwok_nodes(2, prefix="nd-delete")
    token = bound_token(cluster, daemonset_pod(cluster, own))
    for node in (own, other):
        cluster.apply(
            {
                "apiVersion": "deviceplane.io/v1alpha1",
                "kind": "NodeDevices",
                "metadata": {"name": node},
                "spec": {"nodeName": node},
            }
        )
    code, body = api(cluster, "DELETE", f"{ND}/{other}", None, token)
    assert code == 403, body
    assert (
        "ValidatingAdmissionPolicy 'deviceplane-agent-node-scoped' with binding 'deviceplane-agent-node-scoped' "
        f"denied request: deviceplane-agent on node {own} may write only the objects of that node, "
        f"not nodedevices {other}" in body["message"]
    ), body
    assert node_devices(cluster, other) is not None
    # No deleting them all at once either (`deletecollection` is not granted).
    code, body = api(cluster, "DELETE", ND, None, token)
    assert code == 403 and "cannot deletecollection resource" in body["message"], body
    assert node_devices(cluster, other) is not None and node_devices(cluster, own) is not None
