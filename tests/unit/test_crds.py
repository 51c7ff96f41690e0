"""crds/ is generated from the pydantic models and checked in: it must be current, and the generator must produce
structural schemas (what the API server requires of a CRD)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
import yaml
from pydantic import BaseModel, Field

from deviceplane.api import kinds
from deviceplane.api.crd import SchemaError, build_crd, crd_yaml, structural_schema
from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.api.models import AgentView, DevicesStatus, DeviceView, PluginView, ResourceView

ROOT = Path(__file__).resolve().parents[2]


def _gen_module() -> Any:
    spec = importlib.util.spec_from_file_location("gen_crds", ROOT / "scripts" / "gen_crds.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("crd", kinds.ALL, ids=lambda c: c.plural)
def test_checked_in_crd_is_current(crd: Any) -> None:
    path = _gen_module().path_for(crd, ROOT)
    assert path.read_text() == crd_yaml(crd), f"{path} is stale: run `make crds`"


def test_install_manifest_carries_both_crds() -> None:
    gen = _gen_module()
    assert (ROOT / gen.MANIFEST).read_text() == gen.manifest_text(), "manifests/10-crds.yaml is stale: `make crds`"
    docs = list(yaml.safe_load_all((ROOT / gen.MANIFEST).read_text()))
    assert [d["metadata"]["name"] for d in docs] == [c.name for c in kinds.ALL]


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _walk(schema["additionalProperties"], f"{path}.*")
    return out


@pytest.mark.parametrize("crd", kinds.ALL, ids=lambda c: c.plural)
def test_schema_is_structural_and_described(crd: Any) -> None:
    root = build_crd(crd)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs"} & set(node), path
        assert (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, path
        if path.startswith((".spec.", ".status.")) and path.count(".") == 2 and "[" not in path and "*" not in path:
            assert node.get("description"), f"{path} has no description for kubectl explain"


def test_node_devices_crd_names_scope_columns() -> None:
    crd = build_crd(kinds.NODE_DEVICES)
    assert crd["metadata"]["name"] == "nodedevices.deviceplane.io"
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["shortNames"] == ["nd"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Resources",
        "Devices",
        "Healthy",
        "Allocated",
        "Heartbeat",
        "Plugins",
        "Devices-Healthy",
        "Owners-Current",
        "Age",
    ]
    # The conditions only with -o wide; the heartbeat as an age, so a stopped agent shows.
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    conditions = ["Plugins", "Devices-Healthy", "Owners-Current"]
    assert [name for name, c in columns.items() if c.get("priority")] == conditions
    assert columns["Heartbeat"]["type"] == "date"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    # Every printer column reads a field the status schema has (else the column would be always empty).
    for column in version["additionalPrinterColumns"][:-1]:
        node = status
        for part in re.findall(r"\.(\w+)", column["jsonPath"].removeprefix(".status").split("[")[0]):
            node = node["properties"][part]
        assert node, column


def test_device_plugin_config_crd_constraints() -> None:
    crd = build_crd(kinds.DEVICE_PLUGIN_CONFIG)
    assert crd["spec"]["names"]["shortNames"] == ["dpc"]
    version = crd["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Resource",
        "Desired",
        "Ready",
        "Up-to-date",
        "Conflict",
        "Status",
        "Degraded",
        "Age",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["resourceName", "image"]
    props = spec["properties"]
    assert props["target"]["enum"] == ["kubelet", "agent"] and props["target"]["default"] == "kubelet"
    assert props["priorityClassName"]["default"] == "system-node-critical"
    assert props["resourceName"]["x-kubernetes-validations"]
    max_unavailable = props["updateStrategy"]["properties"]["maxUnavailable"]
    assert max_unavailable["x-kubernetes-int-or-string"] is True and max_unavailable["default"] == 1
    assert "x-kubernetes-validations" in max_unavailable
    # Embedded core/v1 types have a schema of their own: a misspelt field is refused, not kept (nor pruned by a
    # schema that lets anything through).
    security = props["securityContext"]
    assert "x-kubernetes-preserve-unknown-fields" not in security and "runAsUser" in security["properties"]
    assert security["properties"]["runAsUser"]["type"] == "integer"
    value_from = props["env"]["items"]["properties"]["valueFrom"]
    assert "x-kubernetes-preserve-unknown-fields" not in value_from and "fieldRef" in value_from["properties"]
    assert value_from["properties"]["fieldRef"]["required"] == ["fieldPath"]
    # A request above its limit is refused by comparing quantities (Kubernetes' CEL quantity library), reported on
    # spec.resources.requests.
    (above,) = [r for r in props["resources"]["x-kubernetes-validations"] if "compareTo" in r["rule"]]
    assert "quantity(string(self.requests[k]))" in above["rule"] and above["fieldPath"] == ".requests"


def test_device_status_json_is_unchanged_but_for_the_totals() -> None:
    """Descriptions change nothing in /api/v1/devices; the totals are derived from the list."""
    plugin = PluginView(
        endpoint="a.sock",
        connected=True,
        preStartRequired=False,
        getPreferredAllocationAvailable=False,
        registeredAt=None,
    )
    resource = ResourceView(
        name="example.com/x",
        capacity=3,
        allocatable=2,
        healthy=2,
        unhealthy=1,
        allocated=1,
        plugin=plugin,
        devices=[DeviceView(id="d0", health="Healthy")],
    )
    status = DevicesStatus(
        resources=[resource, resource], agent=AgentView(version="v", node="n", lastHeartbeatTime="t")
    )
    dumped = status.model_dump(mode="json")
    assert set(dumped) == {
        "resources",
        "agent",
        "conditions",
        "resourceCount",
        "deviceCount",
        "healthyCount",
        "allocatedCount",
    }
    assert dumped["resources"][0]["devices"][0] == {
        "id": "d0",
        "health": "Healthy",
        "numaNodes": [],
        "allocatedTo": None,
    }
    assert (dumped["resourceCount"], dumped["deviceCount"], dumped["healthyCount"], dumped["allocatedCount"]) == (
        2,
        6,
        4,
        2,
    )
    # What the agent publishes parses back (the totals are ignored on input).
    assert DevicesStatus.model_validate(dumped) == status


class _Inner(BaseModel):
    """Inner doc."""

    n: int = Field(default=2, ge=1)


class _Outer(BaseModel):
    inner: _Inner = Field(description="overrides the docstring")
    maybe: str | None = None
    quantity: int | str = 1
    free: dict[str, Any] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)


def test_generator_maps_pydantic_constructs() -> None:
    schema = structural_schema(_Outer, mode="validation")
    props = schema["properties"]
    assert props["inner"] == {
        "type": "object",
        "description": "overrides the docstring",
        "properties": {"n": {"type": "integer", "default": 2, "minimum": 1}},
    }
    assert props["maybe"] == {"type": "string", "nullable": True}
    assert props["quantity"] == {"default": 1, "x-kubernetes-int-or-string": True}
    assert props["free"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert props["labels"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert schema["required"] == ["inner"]


class _Node(BaseModel):
    child: _Node | None = None


class _Union(BaseModel):
    value: int | bool


class _BoundedIntOrString(BaseModel):
    value: Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern="^[0-9]+m$", max_length=8)]


class _MisplacedKeyword(BaseModel):
    value: int | Annotated[str, Field(json_schema_extra={"minimum": 0})]  # an integer's keyword on the string


def test_an_int_or_string_keeps_each_options_own_keywords() -> None:
    assert structural_schema(_BoundedIntOrString, mode="validation")["properties"]["value"] == {
        "x-kubernetes-int-or-string": True,
        "minimum": 0,
        "maxLength": 8,
        "pattern": "^[0-9]+m$",
    }


def test_generator_refuses_what_a_structural_schema_cannot_express() -> None:
    with pytest.raises(SchemaError, match="recursive"):
        structural_schema(_Node, mode="validation")
    with pytest.raises(SchemaError, match="union"):
        structural_schema(_Union, mode="validation")
    with pytest.raises(SchemaError, match="union"):
        structural_schema(_MisplacedKeyword, mode="validation")


def test_spec_model_defaults_match_the_schema_defaults() -> None:
    """What the operator assumes when a field is absent is what the API server fills in."""
    parsed = DevicePluginConfigSpec.model_validate({"resourceName": "example.com/x", "image": "img"})
    props = build_crd(kinds.DEVICE_PLUGIN_CONFIG)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec_props = props["spec"]["properties"]
    for name, node in spec_props.items():
        if "default" in node and node["default"] != {}:
            assert getattr(parsed, name) == node["default"], name
    assert parsed.updateStrategy.model_dump() == {"type": "RollingUpdate", "maxUnavailable": 1}
    assert yaml.safe_load(crd_yaml(kinds.DEVICE_PLUGIN_CONFIG))["kind"] == "CustomResourceDefinition"
