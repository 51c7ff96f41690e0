"""Rendering a DevicePluginConfig into its DaemonSet (pure): golden files for the examples, and the rules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from deviceplane.api.corev1 import QUANTITY_PATTERN
from deviceplane.api.crd import structural_schema
from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator import names
from deviceplane.operator.render import SECURE_DEFAULT, configmap_hash, render_daemonset

from .helpers import EXAMPLES, GOLDEN, load_example, owner, spec


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_render_as_the_golden_files(example: Path) -> None:
    body = load_example(example)
    config = DevicePluginConfigSpec.model_validate(body["spec"])
    rendered = render_daemonset(owner(body["metadata"]["name"]), config)
    text = yaml.safe_dump(rendered, sort_keys=False, width=120)
    golden = GOLDEN / f"{example.stem}.daemonset.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run with UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text(), f"{golden} differs: review, then UPDATE_GOLDEN=1"


def test_there_are_the_three_examples() -> None:
    assert {p.stem for p in EXAMPLES} == {"files", "sim", "generic-device-plugin"}


def test_defaults_priority_secure_context_registration_dir_node_name() -> None:
    ds = render_daemonset(owner("x"), spec())
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["name"] == "x-plugin" and ds["metadata"]["namespace"] == "plugins"
    assert ds["metadata"]["ownerReferences"][0]["uid"] and ds["metadata"]["ownerReferences"][0]["controller"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    container = pod["containers"][0]
    assert container["securityContext"] == SECURE_DEFAULT
    assert container["env"][0] == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert pod["volumes"][0]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"
    assert container["volumeMounts"][0]["mountPath"] == "/var/lib/kubelet/device-plugins"
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert "affinity" not in pod and "nodeSelector" not in pod
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_target_agent_mounts_the_agent_dir_at_the_kubelet_path() -> None:
    pod = render_daemonset(owner("x"), spec(target="agent"))["spec"]["template"]["spec"]
    assert pod["volumes"][0]["hostPath"]["path"] == "/var/lib/deviceplane/device-plugins"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/var/lib/kubelet/device-plugins"


def test_security_context_override_and_on_delete_and_node_name_not_duplicated() -> None:
    ds = render_daemonset(
        owner("x"),
        spec(
            securityContext={"privileged": True},
            updateStrategy={"type": "OnDelete"},
            env=[{"name": "NODE_NAME", "value": "spoof"}, {"name": "A", "value": "1"}],
        ),
    )
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"] == {"privileged": True}
    assert [e["name"] for e in container["env"]] == ["NODE_NAME", "A"]
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_configmap_hash_goes_into_the_pod_template_and_changes_the_render_hash() -> None:
    config = spec(configMapRef={"name": "cfg"})
    a = render_daemonset(owner("x"), config, config_hash=configmap_hash({"k": "1"}, None))
    b = render_daemonset(owner("x"), config, config_hash=configmap_hash({"k": "2"}, None))
    annotation = names.CONFIG_HASH_ANNOTATION
    assert (
        a["spec"]["template"]["metadata"]["annotations"][annotation]
        != (b["spec"]["template"]["metadata"]["annotations"][annotation])
    )
    render = names.RENDER_HASH_ANNOTATION
    assert a["metadata"]["annotations"][render] != b["metadata"]["annotations"][render]
    pod = a["spec"]["template"]["spec"]
    assert {"name": "plugin-config", "configMap": {"name": "cfg"}} in pod["volumes"]
    assert configmap_hash({"a": "1"}, None) == configmap_hash({"a": "1"}, {})


def test_excluded_nodes_become_a_sorted_not_in_affinity_and_the_hash_is_stable() -> None:
    a = render_daemonset(owner("x"), spec(), excluded_nodes=["n2", "n1", "n2"])
    b = render_daemonset(owner("x"), spec(), excluded_nodes=["n1", "n2"])
    assert a == b
    terms = a["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # One value per requirement: the API server refuses a metadata.name field selector with more than one (real
    # apiserver: tests/e2e/test_operator.py::test_a_newer_config_yields_several_nodes_to_an_older_one).
    assert terms["nodeSelectorTerms"] == [
        {
            "matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]},
                {"key": "metadata.name", "operator": "NotIn", "values": ["n2"]},
            ]
        }
    ]
    assert a != render_daemonset(owner("x"), spec())


def test_integer_quantities_go_out_as_strings_from_one_type() -> None:
    """The CRD takes `cpu: 1` and a divisor of 1 (int-or-string), the Kubernetes client refuses an integer quantity:
    both places dump as strings through the one Quantity type, whose schema stays int-or-string."""
    quantity_spec = spec(
        resources={"limits": {"cpu": 1, "memory": "64Mi"}, "requests": {"cpu": 0}},
        env=[{"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": 1}}}],
    )
    assert quantity_spec.resources is not None
    assert quantity_spec.resources.model_dump(exclude_none=True) == {
        "limits": {"cpu": "1", "memory": "64Mi"},
        "requests": {"cpu": "0"},
    }
    assert quantity_spec.env[0].model_dump(exclude_none=True)["valueFrom"]["resourceFieldRef"]["divisor"] == "1"
    container = render_daemonset(owner("q"), quantity_spec)["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"cpu": "1", "memory": "64Mi"}, "requests": {"cpu": "0"}}
    assert container["env"][1]["valueFrom"]["resourceFieldRef"]["divisor"] == "1"
    schema = structural_schema(DevicePluginConfigSpec, mode="validation")["properties"]
    assert schema["resources"]["properties"]["limits"]["additionalProperties"] == {
        "x-kubernetes-int-or-string": True,
        "minimum": 0,  # an integer's bound and a string's form, each applied to values of its type
        "maxLength": 64,
        "pattern": QUANTITY_PATTERN,
    }
    divisor = schema["env"]["items"]["properties"]["valueFrom"]["properties"]["resourceFieldRef"]["properties"]
    assert divisor["divisor"]["x-kubernetes-int-or-string"] is True
