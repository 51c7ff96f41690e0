"""The operator as a demanding GPU-fleet user sees it, against the real control plane: deleting configs (also while
the operator is down), a plugin image that cannot be pulled, what `kubectl get dpc` shows for a config that is not
running its current spec, moving a live config to another resourceName, draining a node, and uninstalling.

Same harness as test_operator.py (its `installed` and `operator` fixtures, re-scoped to this module: one operator
process here).
"""

from __future__ import annotations

import json
import time

from .cluster import Cluster
from .operator_proc import Operator
from .procs import wait_for
from .test_operator import (
    MANIFESTS,
    REFUSED_IN_THE_DAEMONSET,
    ROLLOUT,
    condition,
    delete_configs,
    dpc,
    installed,
    operator,
    pods_by_node,
    ready_on_a_node_of_its_own,
    refusing_policy,
    running_on,
    tag,
    wait_ready,
)

__all__ = ["installed", "operator", "refusing_policy"]  # fixtures, re-used


def row(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get dpc NAME` as {COLUMN: value}."""
    header, line = cluster.kubectl("get", "dpc", name, "-n", namespace).splitlines()[:2]
    return dict(zip(header.split(), line.split(), strict=False))


def managed_objects(cluster: Cluster, namespace: str) -> list[str]:
    """Everything labelled as made by the operator in a namespace (any kind kubectl lists with `all`, ConfigMaps,
    Secrets, ServiceAccounts)."""
    out = cluster.kubectl(
        "get", "all,configmaps,secrets,serviceaccounts", "-n", namespace,
        "-l", "app.kubernetes.io/managed-by=deviceplane-operator", "-o", "name",
    )  # fmt: skip
    return [line for line in out.splitlines() if line.strip()]


# ---- deletion ------------------------------------------------------------------------------------------------


def test_deleting_a_config_while_the_operator_is_down_does_not_hang_and_leaves_nothing(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    cluster = operator.cluster
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "gone")
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "fg")
    body = cluster.get_json("dpc", "gone", "-n", namespace)
    assert not body["metadata"].get("finalizers"), body["metadata"]
    operator.stop()
    try:
        started = time.monotonic()
        cluster.kubectl("delete", "dpc", "gone", "-n", namespace, "--wait=true", "--timeout=30s")
        # Foreground: the API server's own finalizer, released by the garbage collector, not by us.
        cluster.kubectl("delete", "dpc", "fg", "-n", namespace, "--cascade=foreground", "--wait=true", "--timeout=60s")
        print(f"deleted with the operator down in {time.monotonic() - started:.2f} s")
        wait_for(
            "the DaemonSets and pods to be garbage-collected with the operator down",
            lambda: not managed_objects(cluster, namespace),
            timeout=ROLLOUT,
        )
    finally:
        operator.start()
    time.sleep(3)
    assert managed_objects(cluster, namespace) == [], "the restarted operator recreated something"
    assert cluster.get_json("dpc", "-n", namespace)["items"] == []


# ---- image pull failures -------------------------------------------------------------------------------------


def test_an_image_that_cannot_be_pulled_is_reported(operator: Operator, kwok_nodes, namespace: str) -> None:
    """kwok runs no containers, so the kubelet's report is written here as the kubelet writes it (status subresource):
    the container waiting in ImagePullBackOff. The config must say so, naming the pod, and not be Ready."""
    cluster = operator.cluster
    t = tag()
    (node,) = kwok_nodes(1, prefix="pull", labels={f"e2e-pull-{t}": "1"}, taints=[])
    image = "registry.invalid/gpu-plugin:does-not-exist"
    cluster.apply(dpc("pull", namespace, f"example.com/pull-{t}", nodeSelector={f"e2e-pull-{t}": "1"}, image=image))
    wait_for("the plugin pod to be Running on kwok", lambda: running_on(cluster, namespace, "pull") == {node},
             procs=[operator.proc] if operator.proc else [], timeout=ROLLOUT)  # fmt: skip
    pod = pods_by_node(cluster, namespace, "pull")[node]
    message = f'Back-off pulling image "{image}": ErrImagePull: not found'
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "status": {
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady",
                 "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {"name": "plugin", "image": image, "imageID": "", "ready": False, "restartCount": 0,
                 "state": {"waiting": {"reason": "ImagePullBackOff", "message": message}}}
            ],
        }
    }  # fmt: skip
    cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                    "--type=strategic", "-p", json.dumps(status))  # fmt: skip

    def reported() -> bool:
        c = condition(cluster, namespace, "pull", "Degraded")
        return c.get("status") == "True" and "ImagePullBackOff" in c.get("message", "")

    wait_for("Degraded naming ImagePullBackOff", reported, procs=[operator.proc] if operator.proc else [],
             timeout=30)  # fmt: skip
    degraded = condition(cluster, namespace, "pull", "Degraded")
    assert pod["metadata"]["name"] in degraded["message"] and image in degraded["message"], degraded
    wait_for("Ready=False", lambda: condition(cluster, namespace, "pull", "Ready").get("status") == "False",
             timeout=30)  # fmt: skip
    shown = row(cluster, namespace, "pull")
    print(shown)
    assert shown.get("DEGRADED") == "PodsFailing", shown
    delete_configs(cluster, namespace, "pull")


# ---- kubectl get ---------------------------------------------------------------------------------------------


def test_kubectl_get_shows_a_config_whose_change_was_refused_as_not_ready(
    operator: Operator, kwok_nodes, namespace: str, refusing_policy: None
) -> None:
    """A change the API server refuses leaves the old DaemonSet running the old spec: its counts all look healthy
    (DESIRED = READY = UP-TO-DATE), so the table must show, in a column of its own, that the config is not Ready."""
    cluster = operator.cluster
    _, config = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "tbl")
    healthy_table = cluster.kubectl("get", "dpc", "tbl", "-n", namespace)
    healthy = row(cluster, namespace, "tbl")

    cluster.apply({**config, "spec": {**config["spec"], **REFUSED_IN_THE_DAEMONSET}})
    wait_for("Degraded=DaemonSetRejected",
             lambda: condition(cluster, namespace, "tbl", "Degraded").get("reason") == "DaemonSetRejected",
             procs=[operator.proc] if operator.proc else [], timeout=30)  # fmt: skip
    refused_table = cluster.kubectl("get", "dpc", "tbl", "-n", namespace)
    print(healthy_table, refused_table, sep="")
    refused = row(cluster, namespace, "tbl")
    assert refused != healthy, "`kubectl get dpc` shows a refused change exactly like a healthy config"
    assert healthy.get("STATUS") == "Available" and healthy.get("DEGRADED") == "AsExpected", healthy
    assert refused.get("STATUS") == "DaemonSetOutdated" and refused.get("DEGRADED") == "DaemonSetRejected", refused

    cluster.apply(config)  # the refused variable removed: back to Available
    wait_for("STATUS Available", lambda: row(cluster, namespace, "tbl").get("STATUS") == "Available",
             procs=[operator.proc] if operator.proc else [], timeout=ROLLOUT)  # fmt: skip
    delete_configs(cluster, namespace, "tbl")


# ---- resourceName changes and overlapping configs in one namespace -------------------------------------------


def test_changing_the_resource_name_of_a_live_config_moves_its_conflicts(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    cluster = operator.cluster
    t = tag()
    label = f"e2e-rn-{t}"
    (node,) = kwok_nodes(1, prefix="rn", labels={label: "1"}, taints=[])
    first, second = f"example.com/rn-a-{t}", f"example.com/rn-b-{t}"
    cluster.apply(dpc("rn-old", namespace, first, nodeSelector={label: "1"}))
    wait_ready(cluster, operator, namespace, "rn-old", {node})
    time.sleep(1.1)  # creationTimestamp has one-second resolution
    cluster.apply(dpc("rn-new", namespace, second, nodeSelector={label: "1"}))
    wait_ready(cluster, operator, namespace, "rn-new", {node})

    # Same resource now: the newer config yields the node, both say so.
    cluster.kubectl("patch", "dpc", "rn-new", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"resourceName": first}}))  # fmt: skip
    wait_for("rn-new to leave the shared node", lambda: not pods_by_node(cluster, namespace, "rn-new"),
             procs=[operator.proc] if operator.proc else [], timeout=ROLLOUT)  # fmt: skip
    wait_for("both to report the conflict",
             lambda: condition(cluster, namespace, "rn-new", "Conflict").get("reason") == "YieldsNodes"
             and condition(cluster, namespace, "rn-old", "Conflict").get("reason") == "KeepsNodes",
             timeout=30)  # fmt: skip
    ready = condition(cluster, namespace, "rn-new", "Ready")
    assert ready.get("reason") == "NoNodes" and "yielded to older configs" in ready.get("message", ""), ready
    assert running_on(cluster, namespace, "rn-old") == {node}

    # And back: the conflict clears on both sides and the newer config runs on the node again.
    cluster.kubectl("patch", "dpc", "rn-new", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"resourceName": second}}))  # fmt: skip
    wait_ready(cluster, operator, namespace, "rn-new", {node})
    wait_for("the conflict to clear on both",
             lambda: condition(cluster, namespace, "rn-new", "Conflict").get("status") == "False"
             and condition(cluster, namespace, "rn-old", "Conflict").get("status") == "False",
             timeout=30)  # fmt: skip
    delete_configs(cluster, namespace, "rn-old", "rn-new")


# ---- drain ---------------------------------------------------------------------------------------------------


def test_drain_leaves_the_plugin_running_and_the_config_ready(operator: Operator, kwok_nodes, namespace: str) -> None:
    """`kubectl drain --ignore-daemonsets` must not take the device plugin away (the workloads still being evicted
    need it to release their devices), and cordoning is no reason for a status change."""
    cluster = operator.cluster
    node, _ = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "drn")
    before = {p["metadata"]["uid"] for p in pods_by_node(cluster, namespace, "drn").values()}
    cluster.kubectl("drain", node, "--ignore-daemonsets", "--timeout=60s")
    time.sleep(3)
    assert {p["metadata"]["uid"] for p in pods_by_node(cluster, namespace, "drn").values()} == before
    assert condition(cluster, namespace, "drn", "Ready").get("status") == "True"
    cluster.kubectl("uncordon", node)
    delete_configs(cluster, namespace, "drn")


# ---- uninstall (last: it deletes the CRD, and puts it back) ----------------------------------------------------


def test_uninstall_with_configs_present_removes_every_plugin(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "un1")
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "un2")
    operator.stop()  # the operator's Deployment goes first with `kubectl delete -f manifests/`
    crd = str(MANIFESTS / "10-crds.yaml")
    try:
        cluster.kubectl("delete", "crd", "devicepluginconfigs.deviceplane.io", "--wait=true", "--timeout=60s")
        wait_for("every plugin DaemonSet and pod to go", lambda: not managed_objects(cluster, namespace),
                 timeout=ROLLOUT)  # fmt: skip
    finally:
        cluster.kubectl("apply", "-f", crd)
        cluster.kubectl("wait", "--for=condition=Established", "crd/devicepluginconfigs.deviceplane.io",
                        "--timeout=60s")  # fmt: skip
        operator.start()
