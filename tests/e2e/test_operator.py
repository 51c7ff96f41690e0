"""The operator against the real control plane: `kubectl apply -f manifests/`, then DevicePluginConfigs become plugin
DaemonSets whose pods run on exactly the matching kwok nodes; rollouts, drift repair, garbage collection, node
moves, conflicts between configs, refused invalid objects, and no writes at rest.

The operator runs as a real process (`python -m deviceplane operator`) with the ServiceAccount identity the
manifests' RBAC grants (a client certificate for system:serviceaccount:deviceplane-system:deviceplane-operator), so
every test also proves that RBAC is enough. One operator per module; the apiserver's audit log counts its writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.procs import hold_down, wait_steady

from .cluster import REPO, Cluster, KubectlError, denying_policy, http_ok
from .operator_proc import OPERATOR_GROUPS, OPERATOR_USER, Operator
from .procs import Proc, Procs, wait_for

MANIFESTS = REPO / "manifests"
EXAMPLES = MANIFESTS / "examples"
ROLLOUT = 90  # seconds: scheduler + kwok + DaemonSet controller on a loaded 2-core machine


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Cluster:
    """`kubectl apply -f manifests/` (namespace, CRDs, RBAC, operator Deployment, agent files when present)."""
    out = cluster.kubectl("apply", "-f", str(MANIFESTS))
    assert "devicepluginconfigs.deviceplane.io" in out and "clusterrole.rbac.authorization.k8s.io" in out, out
    cluster.kubectl("wait", "--for=condition=Established", "crd/devicepluginconfigs.deviceplane.io", "--timeout=60s")
    return cluster


@pytest.fixture(scope="module")
def operator(installed: Cluster, procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    assert installed.pki is not None
    kubeconfig = installed.pki.kubeconfig(
        installed.server, OPERATOR_USER, OPERATOR_GROUPS, path=tmp_path_factory.mktemp("op") / "operator.kubeconfig"
    )
    op = Operator(installed, procs, kubeconfig)
    op.start()
    yield op
    op.stop()


# A spec the CRD takes and whose DaemonSet the API server then refuses (422), for the tests of DaemonSetRejected. Not
# a core/v1 rule the CRD could copy (it copies them as test_operator_fuzz.py finds them; a request above its limit,
# used here before, is one): the ValidatingAdmissionPolicy `refusing_policy` installs refuses it, as a cluster's own
# admission may.
REFUSE_ENV = "E2E_REFUSE_DAEMONSET"
REFUSED_IN_THE_DAEMONSET = {"env": [{"name": REFUSE_ENV, "value": "1"}]}
REFUSED_BY_POLICY = f"the e2e tests' admission policy refuses DaemonSets whose pods set {REFUSE_ENV}"


@pytest.fixture(scope="module")
def refusing_policy(installed: Cluster) -> Iterator[None]:
    """A ValidatingAdmissionPolicy and its binding denying DaemonSets whose containers set REFUSE_ENV, with reason
    Invalid (422, as the API server's own pod validation answers): a real refusal by the API server, for the
    operator's DaemonSetRejected path. Installed once it refuses a server-side dry run, removed afterwards."""
    name = f"e2e-refuse-daemonsets-{tag()}"
    denies = f"object.spec.template.spec.containers.exists(c, has(c.env) && c.env.exists(e, e.name == '{REFUSE_ENV}'))"
    rule = {
        "apiGroups": ["apps"],
        "apiVersions": ["v1"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["daemonsets"],
    }
    for obj in denying_policy(name, rule, denies, REFUSED_BY_POLICY, "Invalid"):
        installed.apply(obj)
    probe = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "e2e-policy-probe", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "probe"}},
            "template": {
                "metadata": {"labels": {"app": "probe"}},
                "spec": {"containers": [{"name": "c", "image": "x", **REFUSED_IN_THE_DAEMONSET}]},
            },
        },
    }

    def refused() -> bool:  # the API server's policy informer takes a moment to start enforcing a new policy
        try:
            installed.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe))
        except KubectlError as err:
            assert REFUSED_BY_POLICY in err.stderr, err.stderr
            return True
        return False

    wait_for(f"the admission policy {name} to refuse DaemonSets", refused, timeout=30)
    yield
    installed.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name, check=False)


def tag() -> str:
    return os.urandom(3).hex()


def dpc(name: str, namespace: str, resource: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "deviceplane.io/v1alpha1",
        "kind": "DevicePluginConfig",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"resourceName": resource, "image": "localhost/deviceplane:0.1.0", "args": ["plugin", "sim"], **spec},
    }


def pods_by_node(cluster: Cluster, namespace: str, config: str) -> dict[str, dict[str, Any]]:
    items = cluster.get_json("pods", "-n", namespace, "-l", f"deviceplane.io/config={config}")["items"]
    return {p["spec"].get("nodeName", ""): p for p in items if not p["metadata"].get("deletionTimestamp")}


def running_on(cluster: Cluster, namespace: str, config: str) -> set[str]:
    return {n for n, p in pods_by_node(cluster, namespace, config).items() if p["status"].get("phase") == "Running"}


def condition(cluster: Cluster, namespace: str, name: str, kind: str) -> dict[str, Any]:
    status = cluster.get_json("dpc", name, "-n", namespace).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def wait_ready(cluster: Cluster, op: Operator, namespace: str, name: str, nodes: set[str]) -> None:
    assert op.proc is not None
    wait_for(
        f"{namespace}/{name} Running on exactly {sorted(nodes)}",
        lambda: running_on(cluster, namespace, name) == nodes and set(pods_by_node(cluster, namespace, name)) == nodes,
        procs=[op.proc],
        timeout=ROLLOUT,
    )
    wait_for(
        f"{namespace}/{name} Ready",
        lambda: condition(cluster, namespace, name, "Ready").get("status") == "True",
        procs=[op.proc],
        timeout=ROLLOUT,
    )


def ready_on_a_node_of_its_own(
    op: Operator, kwok_nodes: Any, namespace: str, name: str, **spec: Any
) -> tuple[str, dict[str, Any]]:
    """Config `name` selecting one new kwok node by a label of its own, applied and Ready: (the node, the config)."""
    t = tag()
    label = f"e2e-{name}-{t}"
    (node,) = kwok_nodes(1, prefix=name, labels={label: "yes"}, taints=[])
    config = dpc(name, namespace, f"example.com/{name}-{t}", nodeSelector={label: "yes"}, **spec)
    op.cluster.apply(config)
    wait_ready(op.cluster, op, namespace, name, {node})
    return node, config


def delete_configs(cluster: Cluster, namespace: str, *names: str) -> None:
    """Delete configs and wait for their plugin pods to go while the kwok nodes still exist: namespace deletion
    removes pods first, and a pod left on a deleted kwok node (no kubelet, no pod GC here) never goes."""
    cluster.kubectl("delete", "dpc", "-n", namespace, "--ignore-not-found", "--wait=true", *names)
    wait_for(
        f"the plugin pods of {namespace}/{','.join(names)} to be deleted",
        lambda: (
            not cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/managed-by=deviceplane-operator")[
                "items"
            ]
        ),
        timeout=ROLLOUT,
    )


# ---- install + example --------------------------------------------------------------------------------------


def test_files_example_runs_on_exactly_the_matching_nodes(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    cola_taint = [{"key": "example.com/cola", "effect": "NoSchedule", "value": "x"}]
    cola = set(kwok_nodes(2, prefix="cola", labels={"example.com/cola": "true"}, taints=cola_taint))
    kwok_nodes(1, prefix="plain", taints=[])
    cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / "files.yaml"))
    wait_ready(cluster, operator, namespace, "cola", cola)

    ds = cluster.get_json("daemonset", "cola-plugin", "-n", namespace)
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] == {"example.com/cola": "true"}
    assert {"key": "example.com/cola", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    registration = next(v for v in pod["volumes"] if v["name"] == "device-plugins")
    assert registration["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "device-plugins")
    assert mount["mountPath"] == "/var/lib/kubelet/device-plugins"
    owner = ds["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("DevicePluginConfig", "cola", True)

    # `kubectl get dpc` reads well: Desired and Ready match the nodes.
    table = cluster.kubectl("get", "dpc", "-n", namespace).splitlines()
    assert table[0].split()[:6] == ["NAME", "RESOURCE", "DESIRED", "READY", "UP-TO-DATE", "CONFLICT"], table
    assert table[1].split()[:6] == ["cola", "example.com/cola", "2", "2", "2", "False"], table
    body = cluster.get_json("dpc", "cola", "-n", namespace)
    assert not body["metadata"].get("finalizers"), "no finalizer may be left on a config"
    assert not any(k.startswith("kopf.") for k in body["metadata"].get("annotations", {})), body["metadata"]

    # `kubectl explain` reads the generated descriptions.
    assert "Whom the plugin registers with" in cluster.kubectl("explain", "dpc.spec.target")
    assert "Healthy devices over all resources" in cluster.kubectl("explain", "nodedevices.status.healthyCount")

    # The other two examples are valid objects (server-side dry run: schema and CEL rules).
    for example in ("sim.yaml", "generic-device-plugin.yaml"):
        cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(EXAMPLES / example))
    delete_configs(cluster, namespace, "cola")


# ---- invalid objects ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"resourceName": "gpu"}, "resourceName must be an extended resource name"),
        ({"resourceName": "kubernetes.io/gpu"}, "must not be in the kubernetes.io domain"),
        ({"image": None}, "spec.image: Required value"),
        ({"image": " "}, "image must not be empty"),
        ({"updateStrategy": {"maxUnavailable": 0}}, "maxUnavailable must be an integer from 1 to 2147483647 or a"),
        ({"updateStrategy": {"maxUnavailable": 2**31}}, "maxUnavailable must be an integer from 1 to 2147483647 or"),
        ({"target": "gpu-agent"}, 'spec.target: Unsupported value: "gpu-agent": supported values: "kubelet", "agent"'),
        # Embedded core/v1 types have their schema: a typo or a wrong type is refused here, not when the operator
        # sends the DaemonSet (the client refused it there, and the config got no status at all).
        ({"securityContext": {"runAsUSer": 0}}, 'unknown field "spec.securityContext.runAsUSer"'),
        ({"securityContext": {"runAsUser": "0"}}, 'spec.securityContext.runAsUser: Invalid value: "string"'),
        (
            {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName", "apiVersin": "v1"}}}]},
            'unknown field "spec.env[0].valueFrom.fieldRef.apiVersin"',
        ),
        (
            {"env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"key": ""}}}]},
            'spec.env[0].valueFrom.configMapKeyRef.key: Invalid value: "": spec.env[0].valueFrom.configMapKeyRef.key '
            "in body should be at least 1 chars long",
        ),
        ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"key": "k"}}}]}, "name is required: the object in"),
        (
            {"env": [{"name": "A", "valueFrom": {}}]},
            "valueFrom must set exactly one of configMapKeyRef, fieldRef, fileKeyRef, resourceFieldRef, secretKeyRef",
        ),
        # What the CRD took and the API server then refused in the DaemonSet (found by test_operator_fuzz.py): the
        # config is refused now, at `kubectl apply`, with the reason.
        ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "operator must be Exists when key is empty"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "value": "x"}]}, "value must be empty when operator"),
        ({"tolerations": [{"key": "k", "tolerationSeconds": 5}]}, "effect must be NoExecute when tolerationSeconds"),
        ({"tolerations": [{"key": "a b", "operator": "Exists"}]}, "spec.tolerations[0].key in body should match"),
        ({"resources": {"limits": {"cpu": "abc"}}}, "spec.resources.limits.cpu in body should match"),
        ({"resources": {"limits": {"cpu": -1}}}, "spec.resources.limits.cpu in body should be greater than or equal"),
        ({"resources": {"limits": {"cpu gpu": "1"}}}, "limits names must be cpu, memory, ephemeral-storage"),
        ({"resources": {"limits": {"x.io/gpu": "500m"}}}, "limits of extended resources (<domain>/<name>) must be"),
        (
            {"resources": {"limits": {"x.io/gpu": 2}, "requests": {"x.io/gpu": 1}}},
            "the request of an extended resource (<domain>/<name>) must equal its limit",
        ),
        (
            # Quantities compared as quantities (Kubernetes' CEL quantity library), not as text: 0.2 > 100m.
            {"resources": {"limits": {"cpu": "100m", "memory": "1Gi"}, "requests": {"cpu": "0.2", "memory": "1Gi"}}},
            "spec.resources.requests: Invalid value: requests.cpu (0.2) must be less than or equal to "
            "limits.cpu (100m)",
        ),
        ({"priorityClassName": "Not_A_Class"}, "spec.priorityClassName in body should match"),
        ({"env": [{"name": "A=B", "value": "1"}]}, "spec.env[0].name in body should match"),
        (
            {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
            "value and valueFrom exclude each other",
        ),
        ({"nodeSelector": {"a b": "x"}}, "nodeSelector keys must be label keys"),
        ({"nodeSelector": {"a": "x y"}}, "spec.nodeSelector.a in body should match"),
        ({"securityContext": {"runAsUser": 2**31}}, "spec.securityContext.runAsUser in body should be less than"),
        ({"volumes": [{"name": "device-plugins", "hostPath": "/x", "mountPath": "/x"}]}, "are the operator's own"),
        ({"volumes": [{"name": "a", "hostPath": "/x/../y", "mountPath": "/x"}]}, "hostPath must not contain '..'"),
        (
            {
                "volumes": [
                    {"name": "a", "hostPath": "/x", "mountPath": "/m"},
                    {"name": "b", "hostPath": "/y", "mountPath": "/m"},
                ]
            },
            "volumes must have different mountPaths",
        ),
        (
            {
                "volumes": [
                    {"name": "a", "hostPath": "/x", "mountPath": "/m"},
                    {"name": "a", "hostPath": "/y", "mountPath": "/n"},
                ]
            },
            'spec.volumes[1]: Duplicate value: {"name":"a"}',
        ),
        (
            {"volumes": [{"name": "a", "hostPath": "/x", "mountPath": "/var/lib/kubelet/device-plugins"}]},
            "a volume's mountPath must not be /var/lib/kubelet/device-plugins",
        ),
        ({"configMapRef": {"name": "Bad Name"}}, "spec.configMapRef.name in body should match"),
        (
            {"configMapRef": {"name": "cm", "mountPath": "/var/lib/kubelet/device-plugins"}},
            "configMapRef.mountPath must differ from the volumes' mountPaths",
        ),
        (
            {"securityContext": {"privileged": True, "allowPrivilegeEscalation": False}},
            "allowPrivilegeEscalation false and privileged true exclude each other",
        ),
        (
            {"securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["SYS_ADMIN"]}}},
            "allowPrivilegeEscalation false and capabilities.add SYS_ADMIN exclude each other",
        ),
        ({"securityContext": {"procMount": "Unmasked"}}, "procMount Unmasked needs the pod's hostUsers false"),
        (
            {"securityContext": {"seccompProfile": {"type": "RuntimeDefault", "localhostProfile": "p.json"}}},
            "localhostProfile is required with type Localhost and not allowed with any other type",
        ),
        (
            {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.nonsense"}}}]},
            "spec.env[0].valueFrom.fieldRef.fieldPath in body should match",
        ),
        (
            {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName", "apiVersion": "v2"}}}]},
            "apiVersion must be v1",
        ),
        (
            {"env": [{"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.nothing"}}}]},
            "spec.env[0].valueFrom.resourceFieldRef.resource in body should match",
        ),
        (
            {"env": [{"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1m"}}}]},
            "the divisor of a memory, ephemeral-storage or hugepages resource must be one of",
        ),
        (
            {
                "env": [
                    {"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "containerName": "x"}}}
                ]
            },
            "containerName must be plugin, the plugin pods' one container",
        ),
    ],
    ids=[
        *("bad-resource-name", "native-resource", "missing-image", "blank-image", "max-unavailable-0"),
        "max-unavailable-above-int32",
        *("unknown-target", "security-context-typo", "security-context-type", "value-from-typo"),
        *("value-from-key-empty", "value-from-no-name", "value-from-no-source"),
        *("toleration-empty-key-equal", "toleration-exists-with-value", "toleration-seconds-not-noexecute"),
        *("toleration-bad-key", "quantity-not-parsed", "quantity-negative", "resource-bad-name"),
        *("extended-resource-fraction", "extended-resource-overcommitted", "request-above-limit"),
        *("priority-class-name", "env-name"),
        *("env-value-and-value-from", "node-selector-key", "node-selector-value", "run-as-user-range"),
        *("volume-own-name", "volume-backsteps", "volume-same-mount-path", "volume-same-name"),
        *("volume-on-registration-dir", "configmap-name", "configmap-on-registration-dir"),
        *("privileged-without-escalation", "sys-admin-without-escalation", "proc-mount-unmasked"),
        *("localhost-profile-wrong-type", "field-path", "field-ref-api-version", "resource-field"),
        *("divisor", "resource-field-container"),
    ],
)
def test_invalid_objects_are_refused_with_a_clear_message(
    installed: Cluster, namespace: str, spec: dict[str, Any], message: str
) -> None:
    body = dpc("bad", namespace, "example.com/ok")
    body["spec"].update(spec)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    with pytest.raises(KubectlError) as err:
        installed.apply(body)
    assert message in err.value.stderr, err.value.stderr
    assert installed.kubectl("get", "dpc", "-n", namespace, "-o", "name").strip() == ""


def test_a_name_too_long_is_refused_naming_the_field(installed: Cluster, namespace: str) -> None:
    body = dpc("n" * 57, namespace, "example.com/ok")
    with pytest.raises(KubectlError) as err:
        installed.apply(body)
    stderr = err.value.stderr
    assert f'metadata.name: Invalid value: "{"n" * 57}": a DevicePluginConfig name must be at most 56' in stderr, stderr
    assert "<nil>" not in stderr, stderr


# ---- rollouts, drift, relabelling, garbage collection ----------------------------------------------------------


def pod_uids(cluster: Cluster, namespace: str, name: str) -> set[str]:
    return {p["metadata"]["uid"] for p in pods_by_node(cluster, namespace, name).values()}


def test_rollouts_drift_relabel_and_garbage_collection(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    t = tag()
    label = f"e2e-roll-{t}"
    first, second = kwok_nodes(2, prefix="roll", taints=[])
    cluster.kubectl("label", "node", first, f"{label}=yes")
    cluster.kubectl("create", "configmap", "sim-config", "-n", namespace, "--from-literal=devices=4")
    cluster.apply(
        dpc(
            "roll", namespace, f"example.com/roll-{t}", nodeSelector={label: "yes"}, configMapRef={"name": "sim-config"}
        )
    )
    wait_ready(cluster, operator, namespace, "roll", {first})
    ds_name = "roll-plugin"

    def rolled_from(before: set[str]) -> Callable[[], bool]:
        return lambda: (
            (now := pod_uids(cluster, namespace, "roll")) != set()
            and not (now & before)
            and running_on(cluster, namespace, "roll") == {first}
        )

    # 1. New args roll the pods.
    before = pod_uids(cluster, namespace, "roll")
    cluster.kubectl(
        "patch",
        "dpc",
        "roll",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"args":["plugin","sim","--count","2"]}}',
    )
    wait_for("new args to roll the pod", rolled_from(before), procs=[operator.proc], timeout=ROLLOUT)
    args = cluster.get_json("daemonset", ds_name, "-n", namespace)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["plugin", "sim", "--count", "2"]

    # 2. A change of the referenced ConfigMap's content rolls the pods (its hash is in the pod template).
    before = pod_uids(cluster, namespace, "roll")
    cluster.kubectl(
        "patch", "configmap", "sim-config", "-n", namespace, "--type=merge", "-p", '{"data":{"devices":"8"}}'
    )
    wait_for("the ConfigMap change to roll the pod", rolled_from(before), procs=[operator.proc], timeout=ROLLOUT)

    # 3. A hand edit of the DaemonSet is reverted within 10 s.
    cluster.kubectl(
        "patch",
        "daemonset",
        ds_name,
        "-n",
        namespace,
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/template/spec/containers/0/args","value":["--hand-edited"]}]',
    )
    edited = time.monotonic()

    def reverted() -> bool:
        ds = cluster.get_json("daemonset", ds_name, "-n", namespace)
        return ds["spec"]["template"]["spec"]["containers"][0]["args"] == ["plugin", "sim", "--count", "2"]

    wait_for("the operator to revert the hand edit", reverted, procs=[operator.proc], timeout=10)
    print(f"hand edit reverted after {time.monotonic() - edited:.2f} s")

    # 4. Paused: a spec change leaves the DaemonSet alone (and says so); unpausing applies it.
    cluster.kubectl(
        "patch", "dpc", "roll", "-n", namespace, "--type=merge",
        "-p", '{"spec":{"paused":true,"args":["plugin","sim","--count","3"]}}',
    )  # fmt: skip
    wait_for(
        "Progressing=False/Paused",
        lambda: condition(cluster, namespace, "roll", "Progressing").get("reason") == "Paused",
        timeout=30,
    )
    time.sleep(2)
    assert reverted(), "a paused config's DaemonSet changed"
    cluster.kubectl("patch", "dpc", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"paused":false}}')

    def unpaused() -> bool:
        ds = cluster.get_json("daemonset", ds_name, "-n", namespace)
        return ds["spec"]["template"]["spec"]["containers"][0]["args"] == ["plugin", "sim", "--count", "3"]

    wait_for("unpausing to apply the change", unpaused, procs=[operator.proc], timeout=30)

    # 5. Relabelling nodes moves the plugin pod.
    cluster.kubectl("label", "node", first, f"{label}-")
    cluster.kubectl("label", "node", second, f"{label}=yes")
    wait_ready(cluster, operator, namespace, "roll", {second})

    # 6. Deleting the config garbage-collects the DaemonSet and its pods.
    cluster.kubectl("delete", "dpc", "roll", "-n", namespace, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        names = cluster.kubectl("get", "daemonset", "-n", namespace, "-o", "name")
        return ds_name not in names and not pods_by_node(cluster, namespace, "roll")

    wait_for("the DaemonSet and its pods to be garbage-collected", gone, timeout=ROLLOUT)


# ---- degraded: the status names the failing pod and why ----------------------------------------------------------


def test_degraded_names_the_failing_pod_and_the_cause(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    t = tag()
    (node,) = kwok_nodes(1, prefix="small", labels={f"e2e-small-{t}": "1"}, taints=[])
    # A plugin asking for more CPU than the node has: the scheduler leaves its pod Pending (Unschedulable).
    cluster.apply(
        dpc("hungry", namespace, f"example.com/hungry-{t}", nodeSelector={f"e2e-small-{t}": "1"},
            resources={"requests": {"cpu": "64"}})
    )  # fmt: skip

    def degraded() -> bool:
        c = condition(cluster, namespace, "hungry", "Degraded")
        return c.get("status") == "True" and "Insufficient cpu" in c.get("message", "")

    wait_for(
        "Degraded naming the unschedulable pod",
        degraded,
        procs=[operator.proc] if operator.proc else [],
        timeout=ROLLOUT,
    )
    message = condition(cluster, namespace, "hungry", "Degraded")["message"]
    (pod,) = cluster.get_json("pods", "-n", namespace, "-l", "deviceplane.io/config=hungry")["items"]
    assert pod["metadata"]["name"] in message and "Unschedulable" in message, message
    assert condition(cluster, namespace, "hungry", "Ready")["status"] == "False"
    delete_configs(cluster, namespace, "hungry")
    assert node

    # A DaemonSet of the config's name that someone else made is left alone, and the status says so.
    cluster.apply(foreign_daemonset("taken-plugin", namespace))
    cluster.apply(dpc("taken", namespace, f"example.com/taken-{t}"))
    wait_for(
        "Degraded=DaemonSetNotOurs",
        lambda: condition(cluster, namespace, "taken", "Degraded").get("reason") == "DaemonSetNotOurs",
        timeout=30,
    )
    assert "taken-plugin" in condition(cluster, namespace, "taken", "Degraded")["message"]
    live = cluster.get_json("daemonset", "taken-plugin", "-n", namespace)
    assert live["spec"]["template"]["spec"]["containers"][0]["image"] == "foreign:1"
    assert not live["metadata"].get("ownerReferences")


def test_deleting_the_foreign_daemonset_lets_the_operator_create_its_own(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """DaemonSetNotOurs says to delete or rename the DaemonSet in the way; doing so must be enough (it sends the
    operator no event: it is outside the label-filtered watch). The operator retries with its backoff, reading only,
    and creates its own once the other is gone."""
    cluster = operator.cluster
    t = tag()
    label = f"e2e-mine-{t}"
    (node,) = kwok_nodes(1, prefix="mine", labels={label: "yes"}, taints=[])
    cluster.apply(foreign_daemonset("mine-plugin", namespace))
    cluster.apply(dpc("mine", namespace, f"example.com/mine-{t}", nodeSelector={label: "yes"}))
    wait_for("Degraded=DaemonSetNotOurs",
             lambda: condition(cluster, namespace, "mine", "Degraded").get("reason") == "DaemonSetNotOurs",
             procs=[operator.proc], timeout=30)  # fmt: skip
    # A few retries while it stays, and past the reconciler's own look after its status write (5 s): from here on
    # only a retry can notice the deletion.
    time.sleep(8)
    creates = [e for e in operator.writes() if e["verb"] == "create" and e["objectRef"].get("name") == "mine-plugin"]
    assert len(creates) == 1, f"the create was re-sent while the foreign DaemonSet stayed: {len(creates)}"

    cluster.kubectl("delete", "daemonset", "mine-plugin", "-n", namespace)
    wait_ready(cluster, operator, namespace, "mine", {node})
    ds = cluster.get_json("daemonset", "mine-plugin", "-n", namespace)
    assert ds["metadata"]["ownerReferences"][0]["name"] == "mine"
    delete_configs(cluster, namespace, "mine")


def test_pods_that_cannot_be_created_are_degraded_with_the_cause(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """A PriorityClass that does not exist: the DaemonSet controller can create no pod, and says why only in its
    FailedCreate events. After PODS_NOT_CREATED_AFTER (30 s) the config is Degraded/PodsNotCreated with that cause."""
    cluster = operator.cluster
    t = tag()
    label = f"e2e-np-{t}"
    kwok_nodes(2, prefix="np", labels={label: "yes"}, taints=[])
    cluster.apply(dpc("np", namespace, f"example.com/np-{t}", nodeSelector={label: "yes"},
                      priorityClassName="does-not-exist"))  # fmt: skip
    started = time.monotonic()
    wait_for("Degraded=PodsNotCreated",
             lambda: condition(cluster, namespace, "np", "Degraded").get("reason") == "PodsNotCreated",
             procs=[operator.proc], timeout=ROLLOUT)  # fmt: skip
    print(f"PodsNotCreated after {time.monotonic() - started:.1f} s")
    degraded = condition(cluster, namespace, "np", "Degraded")
    assert degraded["message"].startswith("2 plugin pods could not be created: "), degraded
    assert "no PriorityClass with name does-not-exist was found" in degraded["message"], degraded
    assert condition(cluster, namespace, "np", "Ready")["status"] == "False"

    # Fixed: the pods are created and Degraded clears.
    cluster.kubectl("patch", "dpc", "np", "-n", namespace, "--type=json",
                    "-p", json.dumps([{"op": "remove", "path": "/spec/priorityClassName"}]))  # fmt: skip
    wait_for("Degraded to clear", lambda: condition(cluster, namespace, "np", "Degraded").get("status") == "False",
             procs=[operator.proc], timeout=ROLLOUT)  # fmt: skip
    delete_configs(cluster, namespace, "np")


# ---- repairs: the operator's own DaemonSet relabelled, hand-added pod-spec fields, a refused spec, a lost ConfigMap


def test_own_daemonset_relabelled_by_hand_is_adopted_back(operator: Operator, kwok_nodes, namespace: str) -> None:
    """The DaemonSet index is label-filtered: without `app.kubernetes.io/managed-by` (or with another
    `deviceplane.io/config`) the operator's own DaemonSet drops out of it, so the create that follows gets 409. The
    DaemonSet's controller ownerReference still names this config's uid: the operator adopts it back and restores
    its labels, and the config is Ready again (not Degraded/DaemonSetNotOurs)."""
    cluster = operator.cluster
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "lbl")

    def labels() -> dict[str, str]:
        return dict(cluster.get_json("daemonset", "lbl-plugin", "-n", namespace)["metadata"]["labels"])

    def repaired() -> bool:
        restored = labels().get("app.kubernetes.io/managed-by") == "deviceplane-operator"
        ours = labels().get("deviceplane.io/config") == "lbl"
        return restored and ours and condition(cluster, namespace, "lbl", "Ready").get("status") == "True"

    for edit in (["app.kubernetes.io/managed-by-"], ["deviceplane.io/config=elsewhere", "--overwrite"]):
        cluster.kubectl("label", "daemonset", "lbl-plugin", "-n", namespace, *edit)
        wait_for(f"the operator to undo `kubectl label {' '.join(edit)}`", repaired, procs=[operator.proc],
                 timeout=30)  # fmt: skip
        degraded = condition(cluster, namespace, "lbl", "Degraded")
        assert degraded.get("status") == "False", degraded
    delete_configs(cluster, namespace, "lbl")


def test_hand_added_pod_spec_fields_are_reverted_and_defaults_cause_no_update(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """Pod-spec fields the operator does not render for this config (affinity, tolerations, hostNetwork) are still
    its own: added by hand, they are removed. Then, with the real API server's defaults on the live object, more
    reconciles of the unchanged config send no DaemonSet update at all (no update storm)."""
    cluster = operator.cluster
    node, _ = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "aff")
    not_here = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [node]}]}
    added = {
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [not_here]}}
        },
        "tolerations": [{"operator": "Exists"}],
        "hostNetwork": True,
    }
    cluster.kubectl("patch", "daemonset", "aff-plugin", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"template": {"spec": added}}}))  # fmt: skip

    def reverted() -> bool:
        pod_spec = cluster.get_json("daemonset", "aff-plugin", "-n", namespace)["spec"]["template"]["spec"]
        return not set(added) & set(pod_spec)

    wait_for("the operator to remove the hand-added pod-spec fields", reverted, procs=[operator.proc], timeout=15)
    wait_ready(cluster, operator, namespace, "aff", {node})

    assert_unchanged_reconciles_send_no_update(operator, namespace, "aff")
    delete_configs(cluster, namespace, "aff")


def test_removed_false_values_and_added_container_fields_are_reverted_without_fighting_defaults(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """A config rendering false, 0 and empty values (the API server keeps the first two, in pointer fields, and drops
    the empty ones). By hand: `automountServiceAccountToken: false`, `allowPrivilegeEscalation: false` and
    `runAsUser: 0` removed (the pods then mount the token, may escalate, run as the image's user), and `command`,
    `envFrom`, `workingDir`, a `lifecycle` hook and an SELinux type added. The operator puts the pod template back
    exactly as it was; then reconciles of the unchanged config send no DaemonSet update (the real API server's
    defaults are not drift)."""
    cluster = operator.cluster
    security = {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": False, "runAsUser": 0,
        "runAsGroup": 0, "runAsNonRoot": False, "capabilities": {"add": [], "drop": ["ALL"]},
        "seLinuxOptions": {"user": ""},
    }  # fmt: skip
    env = [
        {"name": "EMPTY", "value": ""},
        {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "zro-env", "key": "k", "optional": False}}},
    ]
    tolerations = [{"key": "e2e-zro", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0}]
    node, _ = ready_on_a_node_of_its_own(
        operator, kwok_nodes, namespace, "zro", securityContext=security, env=env, tolerations=tolerations
    )

    def template() -> dict[str, Any]:
        return dict(cluster.get_json("daemonset", "zro-plugin", "-n", namespace)["spec"]["template"])

    before = template()
    generation = cluster.get_json("daemonset", "zro-plugin", "-n", namespace)["metadata"]["generation"]
    sc = "/spec/template/spec/containers/0/securityContext"
    edits = [
        {"op": "remove", "path": "/spec/template/spec/automountServiceAccountToken"},
        {"op": "remove", "path": f"{sc}/allowPrivilegeEscalation"},
        {"op": "remove", "path": f"{sc}/runAsUser"},
        {"op": "add", "path": f"{sc}/seLinuxOptions/type", "value": "spc_t"},
        {"op": "add", "path": "/spec/template/spec/containers/0/command", "value": ["/bin/sh", "-c", "echo replaced"]},
        {"op": "add", "path": "/spec/template/spec/containers/0/envFrom", "value": [{"secretRef": {"name": "x"}}]},
        {"op": "add", "path": "/spec/template/spec/containers/0/workingDir", "value": "/tmp"},
        {"op": "add", "path": "/spec/template/spec/containers/0/lifecycle",
         "value": {"postStart": {"exec": {"command": ["/bin/true"]}}}},
    ]  # fmt: skip
    cluster.kubectl("patch", "daemonset", "zro-plugin", "-n", namespace, "--type=json", "-p", json.dumps(edits))
    wait_for("the operator to revert every hand edit", lambda: template() == before, procs=[operator.proc], timeout=10)
    # The hand edit and the operator's update (the revert may be done before the first read above).
    assert cluster.get_json("daemonset", "zro-plugin", "-n", namespace)["metadata"]["generation"] >= generation + 2
    wait_ready(cluster, operator, namespace, "zro", {node})

    assert_unchanged_reconciles_send_no_update(operator, namespace, "zro")
    delete_configs(cluster, namespace, "zro")


def test_on_delete_says_it_waits_for_pod_deletion(operator: Operator, kwok_nodes, namespace: str) -> None:
    """With updateStrategy OnDelete a change leaves the pods as they are until deleted: the status says so (it read
    RollingOut, Progressing True, forever), and deleting the pod completes it."""
    cluster = operator.cluster
    _, config = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "ond", updateStrategy={"type": "OnDelete"})
    cluster.apply({**config, "spec": {**config["spec"], "args": ["plugin", "sim", "--count", "2"]}})
    wait_for("Progressing=False/WaitingForPodDeletion",
             lambda: condition(cluster, namespace, "ond", "Progressing").get("reason") == "WaitingForPodDeletion",
             procs=[operator.proc], timeout=ROLLOUT)  # fmt: skip
    progressing = condition(cluster, namespace, "ond", "Progressing")
    assert (
        progressing["status"] == "False" and "kubectl delete pod -l deviceplane.io/config=ond" in progressing["message"]
    ), progressing
    assert condition(cluster, namespace, "ond", "Ready")["reason"] == "WaitingForPodDeletion"
    cluster.kubectl("delete", "pod", "-n", namespace, "-l", "deviceplane.io/config=ond", "--wait=false")
    wait_for("Ready once the pod is replaced",
             lambda: condition(cluster, namespace, "ond", "Ready").get("status") == "True",
             procs=[operator.proc], timeout=ROLLOUT)  # fmt: skip
    delete_configs(cluster, namespace, "ond")


def test_a_refused_daemonset_spec_is_not_ready_and_counts_as_failed(
    operator: Operator, kwok_nodes, namespace: str, refusing_policy: None
) -> None:
    """A spec the CRD takes but whose DaemonSet the API server refuses (422, here from an admission policy). The old
    DaemonSet keeps running the previous spec, so the config must not be Ready for its new generation, and the
    reconcile counts as failed. The refused update is sent once."""
    cluster = operator.cluster
    _, config = ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "rej")
    failed = 'deviceplane_operator_reconcile_total{result="failed"}'
    failed_before = operator.metric(failed)

    cluster.apply({**config, "spec": {**config["spec"], **REFUSED_IN_THE_DAEMONSET}})
    wait_for("Degraded=DaemonSetRejected",
             lambda: condition(cluster, namespace, "rej", "Degraded").get("reason") == "DaemonSetRejected",
             procs=[operator.proc], timeout=30)  # fmt: skip
    assert REFUSED_BY_POLICY in condition(cluster, namespace, "rej", "Degraded")["message"]
    ready = condition(cluster, namespace, "rej", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "DaemonSetOutdated", ready
    assert "refused" in ready["message"], ready
    assert operator.metric(failed) > failed_before

    # Sent once: not again for its own status write and that write's echo (past the 5 s echo wait), nor for an
    # annotation on the config; each re-sent it, to be refused the same way.
    cluster.kubectl("annotate", "dpc", "rej", "-n", namespace, "e2e/poke=1")
    time.sleep(7)
    refused = [
        e for e in operator.writes()
        if e["verb"] == "update" and e["objectRef"].get("name") == "rej-plugin"
        and e["objectRef"].get("namespace") == namespace and e["responseStatus"]["code"] == 422
    ]  # fmt: skip
    assert len(refused) == 1, f"the refused update was sent {len(refused)} times"

    cluster.apply(config)  # the resources as before: the DaemonSet matches the config, Ready once more
    wait_for("Ready again", lambda: condition(cluster, namespace, "rej", "Ready").get("status") == "True",
             procs=[operator.proc], timeout=ROLLOUT)  # fmt: skip
    delete_configs(cluster, namespace, "rej")


def test_an_integer_quantity_the_crd_takes_reaches_the_daemonset(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """`cpu: 1` is valid in the CRD (int-or-string, like core/v1 quantities), but the Kubernetes client refuses an
    integer quantity before sending: the DaemonSet was never created and the config got no status at all. It goes
    out as a string now, and the plugin runs."""
    cluster = operator.cluster
    resources = {"limits": {"cpu": 1, "memory": "64Mi"}, "requests": {"cpu": 1}}
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "qty", resources=resources)
    container = cluster.get_json("daemonset", "qty-plugin", "-n", namespace)["spec"]["template"]["spec"]["containers"]
    assert container[0]["resources"] == {"limits": {"cpu": "1", "memory": "64Mi"}, "requests": {"cpu": "1"}}
    assert condition(cluster, namespace, "qty", "Degraded").get("status") == "False"
    delete_configs(cluster, namespace, "qty")


def test_deleting_the_configmap_does_not_roll_the_plugin(operator: Operator, kwok_nodes, namespace: str) -> None:
    """Without its ConfigMap a new plugin pod cannot start (its volume is missing), so deleting the ConfigMap must
    not change the pod template: the running pods stay, the status says Degraded/ConfigMapMissing. Recreating the
    ConfigMap with the same content clears it, still without a rollout."""
    cluster = operator.cluster
    cluster.kubectl("create", "configmap", "cm-config", "-n", namespace, "--from-literal=devices=4")
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "cm", configMapRef={"name": "cm-config"})

    def template() -> dict[str, Any]:
        return dict(cluster.get_json("daemonset", "cm-plugin", "-n", namespace)["spec"]["template"])

    before, pods = template(), pod_uids(cluster, namespace, "cm")
    cluster.kubectl("delete", "configmap", "cm-config", "-n", namespace)
    wait_for("Degraded=ConfigMapMissing",
             lambda: condition(cluster, namespace, "cm", "Degraded").get("reason") == "ConfigMapMissing",
             procs=[operator.proc], timeout=30)  # fmt: skip
    assert template() == before, "deleting the ConfigMap changed the pod template"
    assert pod_uids(cluster, namespace, "cm") == pods

    cluster.kubectl("create", "configmap", "cm-config", "-n", namespace, "--from-literal=devices=4")
    wait_for("Degraded to clear",
             lambda: condition(cluster, namespace, "cm", "Degraded").get("status") == "False",
             procs=[operator.proc], timeout=30)  # fmt: skip
    assert template() == before and pod_uids(cluster, namespace, "cm") == pods
    delete_configs(cluster, namespace, "cm")


@contextlib.contextmanager
def operator_rbac_without(cluster: Cluster, group: str, resource: str, verb: str) -> Iterator[None]:
    """The operator's ClusterRole without one verb on one resource (e.g. `list` on ConfigMaps, its `watch` kept, so
    kopf's running watch, which renews without a list, goes on), then the manifests' RBAC applied back, whatever
    happens in between."""
    role = cluster.get_json("clusterrole", "deviceplane-operator")
    rules = []
    for rule in role["rules"]:
        if resource not in rule.get("resources", []) or group not in rule.get("apiGroups", []):
            rules.append(rule)
            continue
        others = [r for r in rule["resources"] if r != resource]
        verbs = [v for v in rule["verbs"] if v != verb]
        rules += [{**rule, "resources": others}] if others else []  # a rule must name a resource and a verb
        rules += [{**rule, "resources": [resource], "verbs": verbs}] if verbs else []
    role["rules"] = rules
    plural, _, subresource = resource.partition("/")
    can_i = ("auth", "can-i", verb, f"{plural}.{group}" if group else plural, "-A", f"--as={OPERATOR_USER}")
    can_i += (f"--subresource={subresource}",) if subresource else ()
    try:
        cluster.kubectl("replace", "-f", "-", input=json.dumps(role))
        # The RBAC authorizer's cache follows the ClusterRole within moments: wait until it refuses.
        wait_for(f"RBAC to refuse the operator's {verb} of {resource}",
                 lambda: cluster.kubectl(*can_i, check=False).strip() == "no", timeout=30)  # fmt: skip
        yield
    finally:
        cluster.kubectl("apply", "-f", str(MANIFESTS / "20-operator-rbac.yaml"))
        wait_for(f"RBAC to allow the operator's {verb} of {resource} again",
                 lambda: cluster.kubectl(*can_i, check=False).strip() == "yes", timeout=30)  # fmt: skip


def test_a_refused_request_is_degraded_naming_it_and_clears_once_allowed(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """A config whose ConfigMap the operator may not list (403 from RBAC) used to end each reconcile with a log line
    and no status, and was never tried again. Now its Degraded condition names the request and the API server's
    answer, other configs go on, and once RBAC allows the list again the retry (with backoff: RBAC sends the
    operator no event) creates its DaemonSet and the config becomes Ready."""
    assert operator.proc is not None
    cluster = operator.cluster
    log_start = operator.proc.log.stat().st_size
    # A bystander with its ConfigMap already read, and so known from the watch: it needs no list.
    cluster.kubectl("create", "configmap", "by-config", "-n", namespace, "--from-literal=devices=2")
    ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "by", configMapRef={"name": "by-config"})
    bystander_ready = condition(cluster, namespace, "by", "Ready")
    cluster.kubectl("create", "configmap", "rbac-config", "-n", namespace, "--from-literal=devices=2")
    t = tag()
    label = f"e2e-rbac-{t}"
    (node,) = kwok_nodes(1, prefix="rbac", labels={label: "yes"}, taints=[])
    config = dpc("rbac", namespace, f"example.com/rbac-{t}", nodeSelector={label: "yes"},
                 configMapRef={"name": "rbac-config"})  # fmt: skip

    with operator_rbac_without(cluster, "", "configmaps", "list"):
        applied = time.monotonic()
        cluster.apply(config)
        wait_for("Degraded=RequestRefused",
                 lambda: condition(cluster, namespace, "rbac", "Degraded").get("reason") == "RequestRefused",
                 procs=[operator.proc], timeout=30)  # fmt: skip
        print(f"RequestRefused {time.monotonic() - applied:.2f} s after the config was applied")
        degraded = condition(cluster, namespace, "rbac", "Degraded")
        message = degraded["message"]
        assert degraded["status"] == "True", degraded
        # The request, then the API server's status code and its own message.
        assert message.startswith(f"the API server refused listing ConfigMaps in {namespace} named rbac-config: "
                                  '403 Forbidden: configmaps "rbac-config" is forbidden: '), message  # fmt: skip
        assert f'User "{OPERATOR_USER}" cannot list resource "configmaps"' in message, message
        ready, progressing = (condition(cluster, namespace, "rbac", kind) for kind in ("Ready", "Progressing"))
        assert (ready["status"], ready["reason"]) == ("False", "DaemonSetMissing"), ready
        assert (progressing["status"], progressing["reason"]) == ("False", "DaemonSetNotCreated"), progressing
        status = cluster.get_json("dpc", "rbac", "-n", namespace)["status"]
        assert status["observedGeneration"] == 1 and "daemonSet" not in status, status
        assert cluster.kubectl("get", "daemonset", "rbac-plugin", "-n", namespace, check=False).strip() == ""

        # Others go on: a config created meanwhile (no ConfigMap to list) runs; the bystander stays as it was.
        ready_on_a_node_of_its_own(operator, kwok_nodes, namespace, "meanwhile")
        assert condition(cluster, namespace, "by", "Ready") == bystander_ready
        assert condition(cluster, namespace, "by", "Degraded").get("status") == "False"

    allowed = time.monotonic()
    wait_ready(cluster, operator, namespace, "rbac", {node})
    print(f"Ready {time.monotonic() - allowed:.2f} s after RBAC allowed the list again")
    assert condition(cluster, namespace, "rbac", "Degraded").get("status") == "False"
    log = operator.proc.log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "refused listing ConfigMaps" in log, "the refusal is logged too"
    delete_configs(cluster, namespace, "rbac", "by", "meanwhile")


def test_a_refused_status_write_is_logged_counted_and_retried_without_a_hot_loop(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """The status is where the operator reports failures, so a refused status write (RBAC without `patch` on
    devicepluginconfigs/status) can only be logged and counted: the reconcile goes on (the DaemonSet is created and
    runs), the write is tried again with the backoff, not in a loop, and once RBAC allows it the status is written."""
    assert operator.proc is not None
    cluster = operator.cluster
    log_start = operator.proc.log.stat().st_size
    api_errors = 'deviceplane_operator_reconcile_failures_total{cause="api_error"}'
    errors_before, audited_before = operator.metric(api_errors), len(operator.writes())
    t = tag()
    label = f"e2e-nostatus-{t}"
    (node,) = kwok_nodes(1, prefix="nostatus", labels={label: "yes"}, taints=[])

    def refused_status_writes() -> int:
        return sum(
            1
            for e in operator.writes()[audited_before:]
            if e["objectRef"].get("subresource") == "status" and e["objectRef"].get("name") == "nostatus"
            and e["responseStatus"]["code"] == 403
        )  # fmt: skip

    with operator_rbac_without(cluster, "deviceplane.io", "devicepluginconfigs/status", "patch"):
        applied = time.monotonic()
        cluster.apply(dpc("nostatus", namespace, f"example.com/nostatus-{t}", nodeSelector={label: "yes"}))
        wait_for("the plugin to run though its status cannot be written",
                 lambda: running_on(cluster, namespace, "nostatus") == {node}, procs=[operator.proc],
                 timeout=ROLLOUT)  # fmt: skip
        time.sleep(max(0.0, 20 - (time.monotonic() - applied)))  # at least 20 s of refusals to count
        window, refused = time.monotonic() - applied, refused_status_writes()
        print(f"{refused} refused status writes in {window:.1f} s")
        # Backoff 0.5, 1, 2, 4, 8, 16 s, and a retry per event of its DaemonSet and pod: a few dozen at most; a hot
        # loop would send hundreds a second.
        assert 3 <= refused <= 40, refused
        assert not (cluster.get_json("dpc", "nostatus", "-n", namespace).get("status") or {})
        assert operator.metric(api_errors) - errors_before >= refused
        log = operator.proc.log.read_bytes()[log_start:].decode(errors="replace")
        logged = f"reconcile {namespace}/nostatus: the status could not be written: 403 Forbidden"
        assert logged in log, log[-3000:]

    wait_ready(cluster, operator, namespace, "nostatus", {node})
    log = operator.proc.log.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    delete_configs(cluster, namespace, "nostatus")


# ---- conflicts ---------------------------------------------------------------------------------------------


def test_overlapping_configs_older_keeps_shared_nodes(operator: Operator, kwok_nodes, namespace: str) -> None:
    cluster = operator.cluster
    t = tag()
    x, y = f"e2e-x-{t}", f"e2e-y-{t}"
    (only_x,) = kwok_nodes(1, prefix="ox", labels={x: "1"}, taints=[])
    (both,) = kwok_nodes(1, prefix="xy", labels={x: "1", y: "1"}, taints=[])
    (only_y,) = kwok_nodes(1, prefix="oy", labels={y: "1"}, taints=[])
    other_ns = f"{namespace}-b"
    cluster.kubectl("create", "namespace", other_ns)
    try:
        resource = f"example.com/shared-{t}"
        cluster.apply(dpc("old", namespace, resource, nodeSelector={x: "1"}))
        wait_ready(cluster, operator, namespace, "old", {only_x, both})
        time.sleep(1.1)  # creationTimestamp has one-second resolution: make "newer" unambiguous
        cluster.apply(dpc("new", other_ns, resource, nodeSelector={y: "1"}))
        wait_ready(cluster, operator, other_ns, "new", {only_y})
        assert running_on(cluster, namespace, "old") == {only_x, both}

        old_conflict = condition(cluster, namespace, "old", "Conflict")
        new_conflict = condition(cluster, other_ns, "new", "Conflict")
        assert old_conflict["status"] == "True" and f"{other_ns}/new" in old_conflict["message"], old_conflict
        assert new_conflict["status"] == "True" and f"{namespace}/old" in new_conflict["message"], new_conflict
        assert both in new_conflict["message"]
        conflicts = cluster.get_json("dpc", "new", "-n", other_ns)["status"]["conflicts"]
        assert conflicts == [{"config": f"{namespace}/old", "owner": False, "nodes": [both], "nodeCount": 1}]
        table = cluster.kubectl("get", "dpc", "new", "-n", other_ns).splitlines()
        assert table[1].split()[5] == "True", table  # the Conflict column

        # Deleting the older config hands the shared node over.
        cluster.kubectl("delete", "dpc", "old", "-n", namespace)
        wait_ready(cluster, operator, other_ns, "new", {both, only_y})
        wait_for(
            "the conflict to clear",
            lambda: condition(cluster, other_ns, "new", "Conflict").get("status") == "False",
            timeout=30,
        )
    finally:
        delete_configs(cluster, namespace, "old")
        delete_configs(cluster, other_ns, "new")
        cluster.kubectl("delete", "namespace", other_ns, "--wait=false", check=False)


def test_a_newer_config_yields_several_nodes_to_an_older_one(operator: Operator, kwok_nodes, namespace: str) -> None:
    """The newer config runs on three nodes; the older one then selects two of them. The newer one's DaemonSet must
    exclude both (the API server takes one node name per metadata.name requirement: a single NotIn with two names
    was refused, and the newer plugin kept serving the shared nodes next to the older one's)."""
    cluster = operator.cluster
    t = tag()
    x, y = f"e2e-x-{t}", f"e2e-y-{t}"
    (alone,) = kwok_nodes(1, prefix="yo", labels={y: "1"}, taints=[])
    shared = set(kwok_nodes(2, prefix="yx", labels={x: "1", y: "1"}, taints=[]))
    resource = f"example.com/several-{t}"
    cluster.apply(dpc("older", namespace, resource, nodeSelector={f"e2e-none-{t}": "1"}))
    time.sleep(1.1)  # creationTimestamp has one-second resolution: make "newer" unambiguous
    cluster.apply(dpc("newer", namespace, resource, nodeSelector={y: "1"}))
    wait_ready(cluster, operator, namespace, "newer", {alone, *shared})

    cluster.apply(dpc("older", namespace, resource, nodeSelector={x: "1"}))
    wait_ready(cluster, operator, namespace, "older", shared)
    wait_ready(cluster, operator, namespace, "newer", {alone})
    degraded = condition(cluster, namespace, "newer", "Degraded")
    assert degraded.get("status") == "False", degraded
    terms = cluster.get_json("daemonset", "newer-plugin", "-n", namespace)["spec"]["template"]["spec"]["affinity"]
    fields = terms["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert sorted(f["values"][0] for f in fields["matchFields"]) == sorted(shared), fields
    both = set(pods_by_node(cluster, namespace, "older")) & set(pods_by_node(cluster, namespace, "newer"))
    assert both == set(), f"nodes running both plugins: {both}"
    conflict = condition(cluster, namespace, "newer", "Conflict")
    assert conflict.get("reason") == "YieldsNodes" and "2 nodes" in conflict.get("message", ""), conflict
    delete_configs(cluster, namespace, "older", "newer")


def test_an_older_config_whose_daemonset_is_refused_keeps_no_node(
    operator: Operator, kwok_nodes, namespace: str, refusing_policy: None
) -> None:
    """The older config's DaemonSet is refused (the CRD takes the spec, the API server's admission does not), so it
    runs nowhere: the newer config serves the shared node meanwhile, and both say why. Once the older one's spec is
    fixed, its DaemonSet is created and the newer one leaves the node to it."""
    cluster = operator.cluster
    t = tag()
    x, y = f"e2e-x-{t}", f"e2e-y-{t}"
    (shared,) = kwok_nodes(1, prefix="ix", labels={x: "1", y: "1"}, taints=[])
    (alone,) = kwok_nodes(1, prefix="iy", labels={y: "1"}, taints=[])
    resource = f"example.com/idle-{t}"
    cluster.apply(dpc("older", namespace, resource, nodeSelector={x: "1"}, **REFUSED_IN_THE_DAEMONSET))
    wait_for("the older config's DaemonSet to be refused",
             lambda: condition(cluster, namespace, "older", "Degraded").get("reason") == "DaemonSetRejected",
             procs=[operator.proc], timeout=30)  # fmt: skip
    time.sleep(1.1)  # creationTimestamp has one-second resolution: make "newer" unambiguous
    cluster.apply(dpc("newer", namespace, resource, nodeSelector={y: "1"}))
    wait_ready(cluster, operator, namespace, "newer", {shared, alone})
    wait_for("both to say why the newer config keeps the node",
             lambda: "could not be created" in condition(cluster, namespace, "older", "Conflict").get("message", "")
             and "could not be created" in condition(cluster, namespace, "newer", "Conflict").get("message", ""),
             procs=[operator.proc], timeout=30)  # fmt: skip
    assert condition(cluster, namespace, "newer", "Conflict")["reason"] == "KeepsNodes"

    cluster.apply(dpc("older", namespace, resource, nodeSelector={x: "1"}))
    wait_ready(cluster, operator, namespace, "older", {shared})
    wait_ready(cluster, operator, namespace, "newer", {alone})
    wait_for("the newer config to yield the node again",
             lambda: condition(cluster, namespace, "newer", "Conflict").get("reason") == "YieldsNodes",
             procs=[operator.proc], timeout=30)  # fmt: skip
    delete_configs(cluster, namespace, "older", "newer")


def test_an_older_config_paused_before_its_daemonset_was_created_keeps_no_node(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """The older config is created paused, so it never makes a DaemonSet and runs nowhere: the newer config serves
    the shared node meanwhile, and both say why. Unpaused, the older one's DaemonSet is created with the node (it is
    never updated) and the newer one's leaves it in exactly one update."""
    cluster = operator.cluster
    t = tag()
    x, y = f"e2e-px-{t}", f"e2e-py-{t}"
    (shared,) = kwok_nodes(1, prefix="px", labels={x: "1", y: "1"}, taints=[])
    (alone,) = kwok_nodes(1, prefix="py", labels={y: "1"}, taints=[])
    resource = f"example.com/paused-{t}"
    cluster.apply(dpc("older", namespace, resource, nodeSelector={x: "1"}, paused=True))
    wait_for("the older config to say it is paused",
             lambda: condition(cluster, namespace, "older", "Ready").get("reason") == "Paused",
             procs=[operator.proc], timeout=30)  # fmt: skip
    time.sleep(1.1)  # creationTimestamp has one-second resolution: make "newer" unambiguous
    cluster.apply(dpc("newer", namespace, resource, nodeSelector={y: "1"}))
    wait_ready(cluster, operator, namespace, "newer", {shared, alone})
    why = "paused and has no DaemonSet"
    wait_for("both to say why the newer config keeps the node",
             lambda: why in condition(cluster, namespace, "older", "Conflict").get("message", "")
             and why in condition(cluster, namespace, "newer", "Conflict").get("message", ""),
             procs=[operator.proc], timeout=30)  # fmt: skip
    assert condition(cluster, namespace, "newer", "Conflict")["reason"] == "KeepsNodes"
    daemonsets = cluster.get_json("daemonsets", "-n", namespace)["items"]
    assert [d["metadata"]["name"] for d in daemonsets] == ["newer-plugin"], "the paused config made a DaemonSet"

    cluster.kubectl("patch", "dpc", "older", "-n", namespace, "--type=merge", "-p", '{"spec":{"paused":false}}')
    wait_ready(cluster, operator, namespace, "older", {shared})
    wait_ready(cluster, operator, namespace, "newer", {alone})
    wait_for("the newer config to yield the node",
             lambda: condition(cluster, namespace, "newer", "Conflict").get("reason") == "YieldsNodes",
             procs=[operator.proc], timeout=30)  # fmt: skip
    time.sleep(2)  # a needless later write would show by now
    ds_writes = [
        (e["verb"], e["objectRef"].get("name"))
        for e in operator.writes()
        if e["objectRef"].get("resource") == "daemonsets" and e["objectRef"].get("namespace") == namespace
    ]
    assert sorted(ds_writes) == [("create", "newer-plugin"), ("create", "older-plugin"), ("update", "newer-plugin")]
    delete_configs(cluster, namespace, "older", "newer")


# ---- rest: restart without writes, 60 s of steady state --------------------------------------------------------


def test_restart_causes_no_writes_and_steady_state_sends_no_mutating_request(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    cluster = operator.cluster
    # Earlier tests' namespaces and nodes must be gone first: their deletion legitimately changes statuses.
    wait_for(
        "earlier tests' configs to be deleted",
        lambda: all(d["metadata"]["namespace"] == namespace for d in cluster.get_json("dpc", "-A")["items"]),
        timeout=ROLLOUT,
    )
    t = tag()
    label = f"e2e-rest-{t}"
    nodes = set(kwok_nodes(2, prefix="rest", labels={label: "1"}, taints=[]))
    for i in range(3):
        cluster.apply(dpc(f"rest-{i}", namespace, f"example.com/rest-{i}-{t}", nodeSelector={label: "1"}))
    for i in range(3):
        wait_ready(cluster, operator, namespace, f"rest-{i}", nodes)
    assert operator.writes(), "the audit log shows none of the operator's writes: the counting itself is broken"
    time.sleep(3)  # let the last status writes land

    operator.stop()
    before = len(operator.writes())
    configs = len(cluster.get_json("dpc", "-A")["items"])
    operator.start()
    wait_for(
        f"the restarted operator to reconcile all {configs} configs",
        lambda: operator.metric("deviceplane_operator_reconcile_total") >= configs,
        procs=[operator.proc] if operator.proc else [],
        timeout=60,
    )
    time.sleep(60)
    after = operator.writes()[before:]
    assert after == [], [(e["verb"], e["objectRef"]) for e in after]
    assert operator.metric("deviceplane_operator_writes_total") == 0
    assert operator.metric('deviceplane_operator_reconcile_total{result="failed"}') == 0
    delete_configs(cluster, namespace, *(f"rest-{i}" for i in range(3)))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_burst_of_stop_signals_ends_the_operator_cleanly(operator: Operator, sig: signal.Signals) -> None:
    """Ctrl-C held down, or a supervisor repeating SIGTERM: the operator acts on the first and exits 0, the rest do
    not interrupt that exit (asyncio puts the default dispositions back as kopf's loop closes: a late signal then
    killed it, or raised KeyboardInterrupt at exit). A second replica on a namespace nobody uses, as above."""
    extra = Operator(operator.cluster, operator.procs, operator.kubeconfig, ("--namespace", f"e2e-burst-{tag()}"))
    extra.start()
    try:
        assert extra.proc is not None
        popen = extra.proc.popen
        sent = hold_down(popen, sig, interval=0.0005)  # its exit takes a few ms after the first
        log = extra.proc.log.read_text(errors="replace")
        assert popen.returncode == 0, f"exit {popen.returncode} after {sent} signals:\n{log[-3000:]}"
        assert "Traceback" not in log and "Exception ignored" not in log, log[-3000:]
    finally:
        extra.stop()


# ---- peering: replicas with --peering/--priority ----------------------------------------------------------------


def test_a_stalled_operator_loop_is_logged_with_its_stack_and_counted(operator: Operator) -> None:
    """kopf's loop held for 3 s (SIGUSR1 with DEVICEPLANE_DEBUG_FAULTS=1: a fault no real part produces on demand,
    so simulated) past a 2 s threshold: a stalled record with the loop thread's stack naming the blocker, then a
    resumed record of at least the hold, the operator's stall counter up by one, and kopf's health endpoint answering
    again. A second replica, on a namespace nobody uses, so that it reconciles nothing the module's replica does."""
    quiet = f"e2e-watchdog-{tag()}"
    extra = Operator(
        operator.cluster,
        operator.procs,
        operator.kubeconfig,
        ("--namespace", quiet, "--loop-stall-seconds", "2"),
        env=(("DEVICEPLANE_DEBUG_FAULTS", "1"),),
    )
    extra.start()
    try:
        assert extra.proc is not None
        stalls = "deviceplane_operator_event_loop_stalls_total"
        with urllib.request.urlopen(extra.metrics_url, timeout=5) as resp:
            assert f"\n{stalls} " in resp.read().decode()  # the series is there from the start

        def watchdog_records() -> list[dict[str, Any]]:
            assert extra.proc is not None
            lines = extra.proc.log.read_text(errors="replace").splitlines()
            records = [json.loads(line) for line in lines if line.startswith("{")]
            return [r for r in records if r.get("logger") == "deviceplane.loop_watchdog"]

        # Only what follows the signal counts: a busy CI machine may hold a loop for a moment on its own.
        before, seen = extra.metric(stalls), len(watchdog_records())

        def held_and_resumed() -> tuple[dict[str, Any], dict[str, Any]] | None:
            after = watchdog_records()[seen:]
            held = [r for r in after if r["msg"] == "event loop stalled" and "in block_event_loop" in r["stacks"]]
            if not held:
                return None
            resumed = [r for r in after[after.index(held[0]) :] if r["msg"] == "event loop resumed"]
            return (held[0], resumed[0]) if resumed else None

        os.kill(extra.proc.pid, signal.SIGUSR1)
        wait_for("the stall and its end logged", lambda: held_and_resumed() is not None, procs=[extra.proc], timeout=20)
        found = held_and_resumed()
        assert found is not None
        stalled, resumed = found
        loop_section = stalled["stacks"].split("--- thread ")[1]
        assert "[event loop]" in loop_section.splitlines()[0] and "in block_event_loop" in loop_section
        assert resumed["stalled_seconds"] >= 3.0
        assert extra.metric(stalls) >= before + 1
        assert http_ok(extra.health_url)
    finally:
        extra.stop()


def test_peering_the_higher_priority_replica_works_and_hands_back(
    operator: Operator, kwok_nodes, namespace: str
) -> None:
    """Two replicas meet in the ClusterKopfPeering of manifests/extras/peering: the higher priority one reconciles,
    the other pauses and writes nothing; when the higher one stops, the other resumes and reconciles what changed."""
    cluster = operator.cluster
    operator.stop()  # the module's replica runs without peering: it would write regardless
    # The two steps docs/operator.md gives: CRDs (and RBAC), then the peering object.
    peering = MANIFESTS / "extras" / "peering"
    cluster.kubectl("apply", "-f", str(peering / "10-crds.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev", "--timeout=60s")
    out = cluster.kubectl("apply", "-f", str(peering / "20-peering.yaml"))
    assert "clusterkopfpeering.kopf.dev/deviceplane-operator" in out, out
    started: list[Operator] = []

    def replica(priority: int) -> Operator:
        peer = Operator(
            cluster,
            operator.procs,
            operator.kubeconfig,
            ("--peering", "deviceplane-operator", "--priority", str(priority)),
        )
        started.append(peer)
        peer.start()
        return peer

    def log_of(peer: Operator) -> str:
        assert peer.proc is not None
        return peer.proc.log.read_text(errors="replace")

    def alive(*peers: Operator) -> list[Proc]:
        return [p.proc for p in peers if p.proc is not None]

    def ds_args(config: str) -> list[str]:
        items = cluster.get_json("ds", "-n", namespace, "-l", f"deviceplane.io/config={config}")["items"]
        return list(items[0]["spec"]["template"]["spec"]["containers"][0].get("args", [])) if items else []

    writes = "deviceplane_operator_writes_total"
    t = tag()
    label = f"e2e-peer-{t}"
    nodes = set(kwok_nodes(1, prefix="peer", labels={label: "1"}, taints=[]))
    try:
        low = replica(10)
        cluster.apply(dpc("peer-a", namespace, f"example.com/peer-a-{t}", nodeSelector={label: "1"}))
        wait_ready(cluster, low, namespace, "peer-a", nodes)
        assert low.metric(writes) > 0

        high = replica(20)
        wait_for("the lower replica to pause", lambda: "Pausing operations in favour of" in log_of(low),
                 procs=alive(low, high), timeout=30)  # fmt: skip
        # A reconcile the pause found under way may still finish; after that, nothing.
        settled = wait_steady(lambda: low.metric(writes), hold=2, timeout=30, what="the paused replica's writes")
        cluster.apply(dpc("peer-b", namespace, f"example.com/peer-b-{t}", nodeSelector={label: "1"}))
        wait_ready(cluster, high, namespace, "peer-b", nodes)
        assert high.metric(writes) > 0
        assert low.metric(writes) == settled, "the paused replica wrote"
        assert "Possibly conflicting operators" not in log_of(low) + log_of(high)

        high.stop()  # SIGTERM: it leaves the peering object, and the lower one resumes
        wait_for("the lower replica to resume", lambda: "Resuming operations" in log_of(low),
                 procs=alive(low), timeout=30)  # fmt: skip
        args = ["plugin", "sim", "--count", "2"]
        cluster.apply(dpc("peer-b", namespace, f"example.com/peer-b-{t}", nodeSelector={label: "1"}, args=args))
        wait_for("the resumed replica to roll out peer-b's new args", lambda: ds_args("peer-b") == args,
                 procs=alive(low), timeout=ROLLOUT)  # fmt: skip
        assert low.metric(writes) > settled
        delete_configs(cluster, namespace, "peer-a", "peer-b")
    finally:
        for peer in started:
            peer.stop()


def assert_unchanged_reconciles_send_no_update(operator: Operator, namespace: str, name: str) -> None:
    """Three reconciles of the unchanged config (an annotation each: a watch event, no spec change) send no DaemonSet
    update: the API server's defaults are not drift."""
    reconciles, updates = (
        "deviceplane_operator_reconcile_total",
        'deviceplane_operator_writes_total{kind="daemonset_update"}',
    )
    time.sleep(6)  # past the reconciler's echo wait: from here on every reconcile compares the settled object
    before_reconciles, before_updates = operator.metric(reconciles), operator.metric(updates)
    for i in range(3):
        operator.cluster.kubectl("annotate", "dpc", name, "-n", namespace, f"e2e/poke={i}", "--overwrite")
        done = before_reconciles + i + 1
        wait_for(f"reconcile {i + 1} of the unchanged config", lambda done=done: operator.metric(reconciles) >= done,
                 procs=[operator.proc], timeout=30)  # fmt: skip
    assert operator.metric(updates) == before_updates, "an unchanged config's DaemonSet was updated"


def foreign_daemonset(name: str, namespace: str) -> dict[str, Any]:
    """A DaemonSet of a config's name that someone else made (no labels of ours), running nowhere."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "foreign"}},
            "template": {
                "metadata": {"labels": {"app": "foreign"}},
                "spec": {"nodeSelector": {"none": "none"}, "containers": [{"name": "c", "image": "foreign:1"}]},
            },
        },
    }
