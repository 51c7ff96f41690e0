"""Hostile or odd input never crashes the operator's pure functions: a spec either validates or raises a
ValidationError (reported as an InvalidSpec condition), a valid one renders without drift against itself, and any
pod body yields a problem or none."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator.drift import drifted_fields
from deviceplane.operator.render import render_daemonset
from deviceplane.operator.status import pod_problem

from .helpers import owner

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "resourceName", "image", "args", "command", "env", "resources", "nodeSelector", "tolerations",
        "updateStrategy", "target", "volumes", "configMapRef", "securityContext", "paused", "imagePullSecrets",
    ]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=6))
def test_any_spec_validates_or_is_refused_cleanly(raw: dict[str, Any]) -> None:
    body = {"resourceName": "example.com/x", "image": "img", **raw}
    try:
        spec = DevicePluginConfigSpec.model_validate(body)
    except ValidationError:
        return
    rendered = render_daemonset(owner("fuzz"), spec, config_hash="h", excluded_nodes=["n1"])
    assert drifted_fields(rendered, rendered) == []


status_keys = st.sampled_from(
    ["phase", "reason", "message", "conditions", "containerStatuses", "initContainerStatuses"]
)
container_status = st.fixed_dictionaries(
    {"state": st.dictionaries(st.sampled_from(["waiting", "terminated", "running"]), json_values, max_size=2)}
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(status_keys, json_values | st.lists(container_status, max_size=2), max_size=4))
def test_any_pod_body_is_read_without_crashing(status: Any) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n"}, "status": status}
    try:
        pod_problem(pod)
    except (AttributeError, TypeError) as exc:  # pragma: no cover - the assertion below reports it
        raise AssertionError(f"pod_problem crashed on {status!r}: {exc}") from exc
