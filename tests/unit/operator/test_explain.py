"""What `kubectl explain dpc.spec...` prints (the CRD's descriptions) matches what the operator renders."""

from __future__ import annotations

from typing import Any

from deviceplane.api import kinds
from deviceplane.api.crd import build_crd
from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator.names import ConfigKey
from deviceplane.operator.render import SECURE_DEFAULT, Owner, render_daemonset


def _spec_schema() -> dict[str, Any]:
    crd = build_crd(kinds.DEVICE_PLUGIN_CONFIG)
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def test_security_context_description_names_every_secure_default() -> None:
    text = _spec_schema()["securityContext"]["description"]
    words = {"allowPrivilegeEscalation": "privilege escalation", "readOnlyRootFilesystem": "read-only root",
             "capabilities": "capabilities", "seccompProfile": "seccomp"}  # fmt: skip
    assert set(words) == set(SECURE_DEFAULT)
    missing = [k for k, w in words.items() if w not in text]
    assert not missing, f"kubectl explain dpc.spec.securityContext does not mention {missing}: {text!r}"


def test_env_description_says_a_node_name_entry_is_ignored() -> None:
    spec = DevicePluginConfigSpec.model_validate(
        {"resourceName": "example.com/x", "image": "i", "env": [{"name": "NODE_NAME", "value": "mine"}]}
    )
    ds = render_daemonset(Owner(ConfigKey("ns", "x"), "uid"), spec)
    env = ds["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "NODE_NAME"] == [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    ]
    assert "ignored" in _spec_schema()["env"]["description"]


def test_resource_name_description_says_it_is_not_passed_to_the_plugin() -> None:
    spec = DevicePluginConfigSpec.model_validate({"resourceName": "example.com/x", "image": "i"})
    ds = render_daemonset(Owner(ConfigKey("ns", "x"), "uid"), spec)
    assert "example.com/x" not in str(ds["spec"]), "the rendering now passes resourceName: update this test"
    assert "not passed to the plugin" in _spec_schema()["resourceName"]["description"]


def test_printer_columns_show_the_ready_and_degraded_reasons() -> None:
    columns = build_crd(kinds.DEVICE_PLUGIN_CONFIG)["spec"]["versions"][0]["additionalPrinterColumns"]
    by_name = {c["name"]: c["jsonPath"] for c in columns}
    assert by_name.get("Status") == '.status.conditions[?(@.type=="Ready")].reason', by_name
    assert by_name.get("Degraded") == '.status.conditions[?(@.type=="Degraded")].reason', by_name
