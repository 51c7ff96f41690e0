"""The operator on a kube-apiserver with the OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift
and in hardened clusters; off in the package's shared control plane, so the other tests show they do not depend on
it; the agent's own case is test_agent_ownerrefs.py): to
change an ownerReference on an existing object, the writer needs `delete` on it. Without that in the operator's
RBAC, restoring a hand-removed ownerReference and adopting a DaemonSet left by `kubectl delete --cascade=orphan`
were refused (403 "cannot set an ownerRef on a resource you can't delete"), and the orphan was never collected.

A control plane of its own for this module (the `cluster` fixture, overridden here; ~10 s to start), with the
manifests, the operator under their ServiceAccount RBAC, and kwok nodes, as in test_operator.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import ENFORCE_OWNER_REFERENCES, Cluster, serve_cluster
from .operator_proc import Operator
from .procs import Procs, wait_for
from .test_operator import condition, delete_configs, installed, operator, ready_on_a_node_of_its_own

__all__ = ["installed", "operator"]  # fixtures, re-used on this module's cluster


@pytest.fixture(scope="module")
def cluster(k8s_bin: Path, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from serve_cluster(k8s_bin, tmp_path_factory.mktemp("cluster-ownerrefs"), procs, (ENFORCE_OWNER_REFERENCES,))


def owners(cluster: Cluster, namespace: str, name: str) -> list[dict[str, str]]:
    ds = cluster.get_json("daemonset", name, "-n", namespace)
    return list(ds["metadata"].get("ownerReferences") or [])


def test_a_removed_owner_reference_is_restored_under_the_plugin(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "own")
    (ref,) = owners(cluster, namespace, "own-plugin")
    cluster.kubectl("patch", "daemonset", "own-plugin", "-n", namespace, "--type=json",
                    "-p", json.dumps([{"op": "remove", "path": "/metadata/ownerReferences"}]))  # fmt: skip
    wait_for("the operator to restore the ownerReference", lambda: owners(cluster, namespace, "own-plugin") == [ref],
             procs=[operator.proc], timeout=10)  # fmt: skip
    degraded = condition(cluster, namespace, "own", "Degraded")
    assert degraded.get("status") == "False", degraded
    delete_configs(cluster, namespace, "own")


def test_a_daemonset_orphaned_by_its_deleted_config_is_adopted_by_the_new_one_and_collected_with_it(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    cluster = operator.cluster
    _, config = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "orph")
    cluster.kubectl("delete", "dpc", "orph", "-n", namespace, "--cascade=orphan", "--wait=true", "--timeout=60s")
    wait_for("the garbage collector to orphan the DaemonSet", lambda: owners(cluster, namespace, "orph-plugin") == [],
             timeout=60)  # fmt: skip

    cluster.apply(config)  # the same config again: a new uid
    uid = cluster.get_json("dpc", "orph", "-n", namespace)["metadata"]["uid"]
    wait_for("the new config to adopt the DaemonSet",
             lambda: [r["uid"] for r in owners(cluster, namespace, "orph-plugin")] == [uid],
             procs=[operator.proc], timeout=30)  # fmt: skip
    wait_for("Ready", lambda: condition(cluster, namespace, "orph", "Ready").get("status") == "True",
             procs=[operator.proc], timeout=60)  # fmt: skip

    cluster.kubectl("delete", "dpc", "orph", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("the adopted DaemonSet to be garbage-collected with its config",
             lambda: "orph-plugin" not in cluster.kubectl("get", "daemonset", "-n", namespace, "-o", "name"),
             timeout=60)  # fmt: skip
    deletes = [e["objectRef"] for e in operator.writes() if e["verb"] == "delete"]
    assert deletes == [], f"the RBAC's delete is for the admission check only, yet the operator sent: {deletes}"
