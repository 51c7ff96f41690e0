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
