"""Pydantic model → CustomResourceDefinition (apiextensions.k8s.io/v1) with a structural OpenAPI v3 schema.

Generic: any model works. What Kubernetes requires of a structural schema, and how pydantic's JSON Schema maps to it:
- `$ref`/`$defs` are inlined (a CRD schema has no references); titles and `readOnly` dropped;
- `X | None` becomes X with `nullable: true` (absent and null both mean "not set");
- `int | str` becomes `x-kubernetes-int-or-string: true` (quantities, maxUnavailable);
- `dict[str, Any]` / `Any` become `x-kubernetes-preserve-unknown-fields: true` (embedded core/v1 types);
- `Literal[...]` stays an `enum`, `const` becomes a one-value enum, defaults and descriptions are kept;
- `json_schema_extra` passes `x-kubernetes-*` keys through (CEL rules: `x-kubernetes-validations`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

JsonSchema = dict[str, Any]

# Keywords a structural schema may carry (apiextensions JSONSchemaProps); anything else pydantic emits is dropped.
_KEPT = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "required",
    "properties",
    "items",
    "additionalProperties",
    "nullable",
}
_FORMATS = {"int32", "int64", "float", "double", "byte", "date", "date-time", "password", "uuid"}


class SchemaError(ValueError):
    """The model uses a JSON Schema construct a structural CRD schema cannot express."""


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"] = "string"
    description: str = ""
    priority: int = 0

    def render(self) -> JsonSchema:
        out: JsonSchema = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            out["description"] = self.description
        if self.priority:
            out["priority"] = self.priority
        return out


@dataclass(frozen=True)
class CrdSpec:
    """Everything a CRD needs besides the schema's models."""

    group: str
    version: str
    kind: str
    plural: str
    scope: Literal["Namespaced", "Cluster"]
    spec_model: type[BaseModel] | None
    status_model: type[BaseModel] | None
    description: str
    short_names: Sequence[str] = ()
    categories: Sequence[str] = ()
    printer_columns: Sequence[PrinterColumn] = ()
    spec_required: bool = True
    root_validations: Sequence[Mapping[str, str]] = ()  # CEL rules on the whole object
    # CEL rules on metadata.name (self: the name): the API server then names the field in its refusal (a rule at the
    # root printed `<nil>: Invalid value`, and a root rule's fieldPath may not point into metadata).
    name_validations: Sequence[Mapping[str, str]] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.plural}.{self.group}"


def structural_schema(model: type[BaseModel], *, mode: Literal["validation", "serialization"]) -> JsonSchema:
    """The model's JSON Schema, made structural. `serialization` includes computed fields (status written by us)."""
    raw = model.model_json_schema(mode=mode, ref_template="#/$defs/{model}")
    defs: Mapping[str, JsonSchema] = raw.get("$defs", {})
    return _convert(raw, defs, path=model.__name__, seen=())


def _resolve(node: JsonSchema, defs: Mapping[str, JsonSchema], path: str, seen: tuple[str, ...]) -> JsonSchema:
    ref = node["$ref"]
    name = ref.rsplit("/", 1)[-1]
    if name in seen:
        raise SchemaError(f"{path}: recursive model {name} cannot be inlined into a CRD schema")
    target = defs.get(name)
    if target is None:
        raise SchemaError(f"{path}: unresolved $ref {ref}")
    # Keywords next to the $ref (the field's description/default) win over the referenced model's.
    merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return _convert(merged, defs, path, (*seen, name))


def _convert(node: JsonSchema, defs: Mapping[str, JsonSchema], path: str, seen: tuple[str, ...]) -> JsonSchema:
    if "$ref" in node:
        return _resolve(node, defs, path, seen)
    if "allOf" in node and len(node["allOf"]) == 1:
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return _convert({**node["allOf"][0], **rest}, defs, path, seen)
    if "anyOf" in node:
        return _convert_union(node, defs, path, seen)
    if "allOf" in node or "oneOf" in node or "not" in node:
        raise SchemaError(f"{path}: allOf/oneOf/not have no structural CRD equivalent")

    out: JsonSchema = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "const":
            out["enum"] = [value]
        elif key == "format":
            if value in _FORMATS:
                out[key] = value
        elif key in _KEPT:
            out[key] = value
    if "properties" in node:
        out["properties"] = {
            name: _convert(sub, defs, f"{path}.{name}", seen) for name, sub in node["properties"].items()
        }
        out["type"] = "object"
        read_only = {name for name, sub in node["properties"].items() if sub.get("readOnly")}
        required = [r for r in node.get("required", []) if r not in read_only]
        if required:
            out["required"] = required
        else:
            out.pop("required", None)
        out.pop("additionalProperties", None)  # extra="forbid" adds `false`; not allowed beside properties
    elif "additionalProperties" in node:
        extra = node["additionalProperties"]
        if extra is True or extra == {}:
            del out["additionalProperties"]
            out["x-kubernetes-preserve-unknown-fields"] = True
        else:
            out["additionalProperties"] = _convert(extra, defs, f"{path}.*", seen)
    if "items" in node:
        out["items"] = _convert(node["items"], defs, f"{path}[]", seen)
    if out.get("default") is None:
        out.pop("default", None)
    if "type" not in out and not _typeless_ok(out):
        # `Any`: an embedded object we do not model.
        out["x-kubernetes-preserve-unknown-fields"] = True
    return _ordered(out)


_FIRST = ("type", "description", "default", "enum", "nullable")
_LAST = ("required", "properties", "additionalProperties", "items")


def _ordered(out: JsonSchema) -> JsonSchema:
    """Keywords in a stable, readable order: what it is first, what it contains last."""
    middle = sorted(k for k in out if k not in _FIRST and k not in _LAST)
    return {k: out[k] for k in (*_FIRST, *middle, *_LAST) if k in out}


def _typeless_ok(out: JsonSchema) -> bool:
    return bool(out.get("x-kubernetes-preserve-unknown-fields") or out.get("x-kubernetes-int-or-string"))


_INTEGER_ONLY = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_STRING_ONLY = {"pattern", "minLength", "maxLength"}


def _int_or_string_keywords(options: list[JsonSchema]) -> bool:
    """Whether an int | str union's options carry only keywords that apply to their own type."""
    for option in options:
        allowed = _INTEGER_ONLY if option["type"] == "integer" else _STRING_ONLY
        if not set(option) - {"type"} <= allowed:
            return False
    return True


def _convert_union(node: JsonSchema, defs: Mapping[str, JsonSchema], path: str, seen: tuple[str, ...]) -> JsonSchema:
    options = node["anyOf"]
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    non_null = [o for o in options if o.get("type") != "null"]
    nullable = len(non_null) < len(options)
    types = sorted(o.get("type", "") for o in non_null)
    if len(non_null) == 1:
        out = _convert({**non_null[0], **rest}, defs, path, seen)
    elif types == ["integer", "string"] and _int_or_string_keywords(non_null):
        # The options' own keywords (an integer's minimum, a string's pattern) apply to values of their type only,
        # as the API server reads them on an int-or-string node (controller-gen writes quantities so).
        merged = {k: v for o in non_null for k, v in o.items() if k != "type"}
        out = _convert({**merged, **rest}, defs, path, seen)
        out.pop("x-kubernetes-preserve-unknown-fields", None)
        out["x-kubernetes-int-or-string"] = True
    else:
        raise SchemaError(f"{path}: union {types} has no structural CRD equivalent (only X | None and int | str)")
    if nullable:
        out["nullable"] = True
    return _ordered(out)


def build_crd(spec: CrdSpec) -> JsonSchema:
    """The CustomResourceDefinition object for `spec`, ready to dump as YAML."""
    properties: JsonSchema = {
        "apiVersion": {"type": "string", "description": "Versioned schema of this representation of an object."},
        "kind": {"type": "string", "description": "The REST resource this object represents."},
        "metadata": {"type": "object"},
    }
    if spec.name_validations:
        name = {"type": "string", "x-kubernetes-validations": [dict(rule) for rule in spec.name_validations]}
        properties["metadata"] = {"type": "object", "properties": {"name": name}}
    if spec.spec_model is not None:
        properties["spec"] = structural_schema(spec.spec_model, mode="validation")
    if spec.status_model is not None:
        properties["status"] = structural_schema(spec.status_model, mode="serialization")
    root: JsonSchema = {"type": "object", "description": spec.description, "properties": properties}
    if spec.spec_model is not None and spec.spec_required:
        root["required"] = ["spec"]
    if spec.root_validations:
        root["x-kubernetes-validations"] = [dict(rule) for rule in spec.root_validations]

    version: JsonSchema = {"name": spec.version, "served": True, "storage": True}
    if spec.status_model is not None:
        version["subresources"] = {"status": {}}
    if spec.printer_columns:
        columns = [c.render() for c in spec.printer_columns]
        version["additionalPrinterColumns"] = [
            *columns,
            PrinterColumn("Age", ".metadata.creationTimestamp", "date").render(),
        ]
    version["schema"] = {"openAPIV3Schema": root}

    names: JsonSchema = {
        "kind": spec.kind,
        "listKind": f"{spec.kind}List",
        "plural": spec.plural,
        "singular": spec.kind.lower(),
    }
    if spec.short_names:
        names["shortNames"] = list(spec.short_names)
    if spec.categories:
        names["categories"] = list(spec.categories)
    metadata: JsonSchema = {"name": spec.name}
    if spec.labels:
        metadata["labels"] = dict(spec.labels)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": metadata,
        "spec": {"group": spec.group, "names": names, "scope": spec.scope, "versions": [version]},
    }


def crd_yaml(spec: CrdSpec) -> str:
    """The CRD as the YAML checked in under crds/ (a header saying where it comes from, then the object)."""
    import yaml  # only the generator and its test need YAML

    header = "# Generated by scripts/gen_crds.py (`make crds`) from deviceplane/api; do not edit.\n"
    return header + yaml.safe_dump(build_crd(spec), sort_keys=False, width=120)
