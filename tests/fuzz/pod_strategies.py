"""Hypothesis strategies for static pod files: pod-shaped documents with any value in any field, mixed key types,
odd YAML scalars, and raw bytes."""

from __future__ import annotations

import json
from typing import Any

import yaml
from hypothesis import strategies as st

RESOURCE = "example.com/fz"

# YAML scalars that resolve to something surprising (bools, nulls, floats, dates, binary, sets, huge ints, anchors).
ODD_SCALARS = [
    "yes", "no", "on", "off", "~", "null", "Null", ".inf", "-.inf", ".nan", "0x1F", "0o17", "0b101", "1e3", "1_000",
    "2020-01-01", "2020-01-01T00:00:00Z", "!!binary aGk=", "!!set {a, b}", "!!str 1", "!!int '7'", "!!float 1",
    "12345678901234567890123", "9" * 5000, "'quoted'", '"\\u0000"', '"\\ud800"', "-1", "+1", "0", "1.5", "500m",
    "1Ki", "2k", "0.0", "-0", "[]", "{}", "[1, [2, [3]]]", "{1: a, b: c}", "{null: x, true: y, 1.5: z}",
    "&a [x, *a]", "*undefined", "| \n  text", "? [a, b]\n  : c", "!!python/object:os.system x", "!custom 1",
]  # fmt: skip

KEYS = st.one_of(
    st.text(max_size=12),
    st.integers(-5, 5),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, width=16),
    st.sampled_from(["name", "limits", "requests", "uid", "namespace", RESOURCE]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(
        ["1", "2", "0", "-1", "1k", "1Ki", "500m", "0.5", " 2 ", "1000m", "2.0", "1e3", "Always", "Succeeded", "Failed"]
    ),
)
ANY = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12
)


def maybe(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(good, good, good, ANY)


LIMITS = st.dictionaries(
    st.one_of(st.just(RESOURCE), st.just("cpu"), KEYS),
    maybe(st.integers(0, 5) | st.sampled_from(["1", "2", "0"])),
    max_size=3,
)
# v1.36 ContainerRestartRules: any container may set restartPolicy, and restartPolicyRules with it.
RESTART_RULES = st.lists(
    st.fixed_dictionaries(
        {"action": st.sampled_from(["Restart", "RestartAllContainers"])},
        optional={"exitCodes": st.fixed_dictionaries({"operator": st.sampled_from(["In", "NotIn"]),
                                                      "values": st.lists(st.integers(0, 255), max_size=3)})},
    ),
    max_size=2,
)  # fmt: skip
CONTAINER = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["a", "b", "c", "main"]))},
    optional={
        "resources": maybe(st.fixed_dictionaries({}, optional={"limits": maybe(LIMITS), "requests": maybe(LIMITS)})),
        "restartPolicy": maybe(st.sampled_from(["Always", "Never", "OnFailure"])),
        "restartPolicyRules": maybe(RESTART_RULES),
        "image": ANY,
    },
)
POD = st.fixed_dictionaries(
    {
        "metadata": maybe(
            st.fixed_dictionaries(
                {"name": maybe(st.sampled_from(["p", "q", "r", "s"]))},
                optional={
                    "namespace": maybe(st.just("default")),
                    "uid": maybe(st.uuids().map(str)),
                    "labels": st.dictionaries(KEYS, SCALARS, max_size=3),
                },
            )
        ),
        "spec": maybe(
            st.fixed_dictionaries(
                {"containers": maybe(st.lists(CONTAINER, max_size=3))},
                optional={"initContainers": maybe(st.lists(CONTAINER, max_size=2))},
            )
        ),
    },
    optional={
        "apiVersion": maybe(st.just("v1")),
        "kind": maybe(st.just("Pod")),
        "status": maybe(st.fixed_dictionaries({"phase": maybe(st.sampled_from(["Running", "Succeeded", "Failed"]))})),
    },
)


def _yaml(document: Any) -> bytes:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()


@st.composite
def with_odd_scalar(draw: st.DrawFn) -> bytes:
    """A YAML pod whose field at one place is replaced by an odd scalar's text."""
    field = draw(st.sampled_from(["NAME", "NS", "UID", "COUNT", "PHASE", "CNAME", "LABEL"]))
    odd = draw(st.sampled_from(ODD_SCALARS))
    values = {"NAME": "p", "NS": "default", "UID": "u-1", "COUNT": "1", "PHASE": "Running", "CNAME": "c",
              "LABEL": "x"} | {field: odd}  # fmt: skip
    return (
        "apiVersion: v1\nkind: Pod\n"
        f"metadata:\n  name: {values['NAME']}\n  namespace: {values['NS']}\n  uid: {values['UID']}\n"
        f"  labels:\n    l: {values['LABEL']}\n"
        f"spec:\n  containers:\n  - name: {values['CNAME']}\n    resources:\n      limits:\n"
        f"        {RESOURCE}: {values['COUNT']}\n"
        f"status:\n  phase: {values['PHASE']}\n"
    ).encode()


def _encode(document: Any, as_json: bool) -> bytes:
    if as_json:
        try:
            return json.dumps(document, allow_nan=True).encode()
        except (TypeError, ValueError):
            return _yaml(document)
    try:
        return _yaml(document)
    except yaml.YAMLError:
        return json.dumps(document, default=str).encode()


@st.composite
def pod_file(draw: st.DrawFn) -> tuple[str, bytes]:
    """(file name, content): structured YAML or JSON, a template with an odd scalar, or raw bytes."""
    kind = draw(st.sampled_from(["structured", "structured", "odd", "raw"]))
    if kind == "raw":
        return draw(st.sampled_from(["f.yaml", "f.json", "f"])), draw(st.binary(max_size=200))
    if kind == "odd":
        return "f.yaml", draw(with_odd_scalar())
    as_json = draw(st.booleans())
    return ("f.json" if as_json else "f.yaml"), _encode(draw(POD), as_json)
