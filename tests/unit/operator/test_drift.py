"""Drift: what the API server adds is not drift (golden objects are real apiserver answers: `kubectl create
--dry-run=server` of the golden DaemonSets); a hand edit of a field we own is."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplane.operator.drift import drifted_fields, render_hash

from .helpers import GOLDEN, spec

EXAMPLE_NAMES = ("files", "sim", "generic-device-plugin")


def _pair(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    rendered = yaml.safe_load((GOLDEN / f"{name}.daemonset.yaml").read_text())
    live = json.loads((GOLDEN / f"{name}.daemonset.apiserver.json").read_text())
    return rendered, live


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_apiserver_defaults_are_not_drift(name: str) -> None:
    rendered, live = _pair(name)
    assert live != rendered  # the API server did add defaults
    assert drifted_fields(rendered, live) == []
    assert render_hash(live) == render_hash(rendered) is not None


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda ds: ds["spec"]["template"]["spec"]["containers"][0].update(args=["--evil"]), "args"),
        (lambda ds: ds["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "X"}), "env"),
        (lambda ds: ds["spec"]["template"]["spec"].update(priorityClassName="low"), "priorityClassName"),
        (lambda ds: ds["spec"]["template"]["spec"]["volumes"][0]["hostPath"].update(path="/tmp"), "volumes"),
        (lambda ds: ds["metadata"]["labels"].pop("deviceplane.io/config"), "labels"),
        (lambda ds: ds["metadata"].update(ownerReferences=[]), "ownerReferences"),
        (lambda ds: ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(memory="1Gi"), "res"),
    ],
)
def test_hand_edits_of_owned_fields_are_drift(edit: Any, path: str) -> None:
    rendered, live = _pair("files")
    edited = copy.deepcopy(live)
    edit(edited)
    assert drifted_fields(rendered, edited), path


def test_quantities_compare_by_value() -> None:
    rendered, live = _pair("files")
    live = copy.deepcopy(live)
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "33554432"  # = 32Mi
    assert drifted_fields(rendered, live) == []


def test_fields_we_do_not_set_are_left_alone() -> None:
    rendered, live = _pair("files")
    live = copy.deepcopy(live)
    live["metadata"]["labels"]["team"] = "gpu"
    live["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 5
    assert drifted_fields(rendered, live) == []


def test_spec_without_optional_fields_still_compares() -> None:
    from deviceplane.operator.render import render_daemonset

    from .helpers import owner

    rendered = render_daemonset(owner("y"), spec())
    assert drifted_fields(rendered, rendered) == []
    assert drifted_fields(rendered, {"metadata": {}, "spec": {}})


def test_golden_files_exist_for_every_example() -> None:
    for name in EXAMPLE_NAMES:
        assert Path(GOLDEN / f"{name}.daemonset.apiserver.json").exists()


# Pod-spec fields we own even when the config does not render them: added by hand, they are drift.
HAND_ADDED = [
    ("nodeSelector", {"kubernetes.io/hostname": "only-this-one"}),
    ("tolerations", [{"operator": "Exists"}]),
    ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}),
    ("hostNetwork", True),
    ("hostPID", True),
    ("hostIPC", True),
    ("initContainers", [{"name": "init", "image": "busybox"}]),
    ("serviceAccountName", "powerful"),
    ("securityContext", {"runAsUser": 0}),
]


@pytest.mark.parametrize(("field", "value"), HAND_ADDED, ids=[f for f, _ in HAND_ADDED])
def test_hand_added_pod_spec_fields_we_do_not_render_are_drift(field: str, value: Any) -> None:
    """The sim example renders neither tolerations nor affinity nor host namespaces; its DaemonSet is the real API
    server's answer. nodeSelector is checked on a config without one."""
    if field == "nodeSelector":
        from deviceplane.operator.render import render_daemonset

        from .helpers import owner

        rendered = render_daemonset(owner("y"), spec())
        live = copy.deepcopy(rendered)
    else:
        rendered, live = _pair("sim")
        live = copy.deepcopy(live)
    assert field not in rendered["spec"]["template"]["spec"]
    live["spec"]["template"]["spec"][field] = value
    assert drifted_fields(rendered, live) == [f"spec.template.spec.{field}"]


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_empty_or_false_owned_pod_fields_are_not_drift(name: str) -> None:
    """The API server defaults the pod securityContext to {} and omits false booleans: equal to absent."""
    rendered, live = _pair(name)
    live = copy.deepcopy(live)
    live["spec"]["template"]["spec"].update(hostNetwork=False, initContainers=[], serviceAccountName="")
    assert live["spec"]["template"]["spec"]["securityContext"] == {}
    assert drifted_fields(rendered, live) == []


def test_a_canonicalised_divisor_is_not_drift() -> None:
    """env valueFrom.resourceFieldRef.divisor is a quantity, canonicalised by the API server like resources."""
    from deviceplane.operator.render import render_daemonset

    from .helpers import owner

    env = [{"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "0.001"}}}]
    rendered = render_daemonset(owner("y"), spec(env=env))
    live = copy.deepcopy(rendered)
    divisor = live["spec"]["template"]["spec"]["containers"][0]["env"][1]["valueFrom"]["resourceFieldRef"]
    divisor["divisor"] = "1m"
    assert drifted_fields(rendered, live) == []
    divisor["divisor"] = "1"
    assert drifted_fields(rendered, live) == [
        "spec.template.spec.containers[0].env[1].valueFrom.resourceFieldRef.divisor"
    ]


# ---- false and 0 are values the API server keeps; container fields and securityContext keys added by hand ----------

# Every boolean and integer pointer field the operator can render, at false/0, and empty strings and lists, which the
# API server drops. golden/zeros.daemonset.apiserver.json is the real apiserver's answer (`kubectl create
# --dry-run=server`, v1.36) for this rendering, with excluded nodes n1 and n2.
ZEROS = {
    "securityContext": {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": False,
        "runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0, "capabilities": {"add": [], "drop": []},
        "seLinuxOptions": {"user": "", "level": ""}, "seccompProfile": {"type": "RuntimeDefault"},
    },
    "env": [
        {"name": "EMPTY", "value": ""},
        {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k", "optional": False}}},
        {"name": "DIV", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": 1}}},
    ],
    "tolerations": [
        {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0},
        {"key": "e", "operator": "Equal", "value": "", "effect": "NoSchedule"},
    ],
    "volumes": [{"name": "dev", "hostPath": "/dev", "mountPath": "/dev", "readOnly": False}],
    "resources": {"limits": {"cpu": 0}},
}  # fmt: skip


def _zeros() -> tuple[dict[str, Any], dict[str, Any]]:
    from deviceplane.operator.render import render_daemonset

    from .helpers import owner

    rendered = render_daemonset(
        owner("zeros"), spec(resourceName="example.com/zeros", **ZEROS), excluded_nodes=["n1", "n2"]
    )
    live = json.loads((GOLDEN / "zeros.daemonset.apiserver.json").read_text())
    assert render_hash(live) == render_hash(rendered), "the rendering changed: regenerate the golden answer"
    return rendered, live


def test_false_zero_and_empty_values_as_the_api_server_stores_them_are_not_drift() -> None:
    rendered, live = _zeros()
    assert drifted_fields(rendered, live) == []


SC = "spec.template.spec.containers[0].securityContext"


@pytest.mark.parametrize(
    ("remove", "path"),
    [
        (("automountServiceAccountToken",), "spec.template.spec.automountServiceAccountToken"),
        (("containers", 0, "securityContext", "allowPrivilegeEscalation"), f"{SC}.allowPrivilegeEscalation"),
        (("containers", 0, "securityContext", "runAsUser"), f"{SC}.runAsUser"),
        (("containers", 0, "securityContext", "privileged"), f"{SC}.privileged"),
        (("containers", 0, "env", 2, "valueFrom", "configMapKeyRef", "optional"), "optional"),
        (("tolerations", 0, "tolerationSeconds"), "tolerationSeconds"),
    ],
    ids=["automount", "allowPrivilegeEscalation", "runAsUser", "privileged", "optional", "tolerationSeconds"],
)
def test_a_removed_false_or_zero_is_drift(remove: tuple[Any, ...], path: str) -> None:
    """The API server keeps these (pointer fields): absent, the pod runs with the default instead (a mounted
    service account token, privilege escalation allowed, the image's user), so removing one by hand is drift."""
    rendered, live = _zeros()
    edited = copy.deepcopy(live)
    target = edited["spec"]["template"]["spec"]
    for key in remove[:-1]:
        target = target[key]
    del target[remove[-1]]
    drift = drifted_fields(rendered, edited)
    assert len(drift) == 1 and drift[0].endswith(path), drift


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_the_examples_false_values_removed_are_drift(name: str) -> None:
    rendered, live = _pair(name)
    edited = copy.deepcopy(live)
    del edited["spec"]["template"]["spec"]["automountServiceAccountToken"]
    security = edited["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    removed = {"spec.template.spec.automountServiceAccountToken"}
    if security.pop("allowPrivilegeEscalation", True) is False:  # generic-device-plugin's is {privileged: true}
        removed.add(f"{SC}.allowPrivilegeEscalation")
    assert set(drifted_fields(rendered, edited)) == removed


CONTAINER_ADDED = [
    ("command", ["/bin/sh", "-c", "echo replaced"]),
    ("workingDir", "/tmp"),
    ("envFrom", [{"secretRef": {"name": "x"}}]),
    ("volumeDevices", [{"name": "dev", "devicePath": "/dev/xvda"}]),
    ("lifecycle", {"postStart": {"exec": {"command": ["/bin/sh", "-c", "curl evil"]}}}),
    ("livenessProbe", {"exec": {"command": ["/bin/true"]}}),
    ("ports", [{"containerPort": 80, "hostPort": 80}]),
]


@pytest.mark.parametrize(("field", "value"), CONTAINER_ADDED, ids=[f for f, _ in CONTAINER_ADDED])
def test_hand_added_container_fields_we_do_not_render_are_drift(field: str, value: Any) -> None:
    """sim renders no command, and none of these; its DaemonSet is the real API server's answer."""
    rendered, live = _pair("sim")
    live = copy.deepcopy(live)
    container = live["spec"]["template"]["spec"]["containers"][0]
    assert field not in rendered["spec"]["template"]["spec"]["containers"][0]
    container[field] = value
    assert drifted_fields(rendered, live) == [f"spec.template.spec.containers[0].{field}"]


def test_hand_added_resources_are_drift_and_the_api_servers_empty_ones_are_not() -> None:
    from deviceplane.operator.render import render_daemonset

    from .helpers import owner

    rendered = render_daemonset(owner("y"), spec())
    live = copy.deepcopy(rendered)
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {}
    assert drifted_fields(rendered, live) == []
    container["resources"] = {"limits": {"cpu": "64"}}
    assert drifted_fields(rendered, live) == ["spec.template.spec.containers[0].resources"]


@pytest.mark.parametrize(
    ("added", "path"),
    [
        ({"privileged": True}, f"{SC}.privileged"),
        ({"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}, f"{SC}.capabilities.add"),
    ],
    ids=["privileged", "capabilities-add"],
)
def test_a_field_added_to_the_container_security_context_is_drift(added: dict[str, Any], path: str) -> None:
    """The API server adds nothing to a container's securityContext (the golden answers show it as rendered)."""
    rendered, live = _pair("files")
    live = copy.deepcopy(live)
    live["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(added)
    assert drifted_fields(rendered, live) == [path]
