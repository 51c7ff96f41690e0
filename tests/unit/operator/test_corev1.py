"""The core/v1 types a DevicePluginConfig embeds (deviceplane/api/corev1.py) against the official Kubernetes client's
models: the same field names and required fields, and whatever a config that passes our models renders is a
DaemonSet the client sends (it checks a body against its models before sending: a field it does not know, or an
integer quantity, was refused there, so the config got no status at all)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client
from pydantic import BaseModel, ValidationError

from deviceplane.api import corev1
from deviceplane.api.dpc import DevicePluginConfigSpec
from deviceplane.operator.render import render_daemonset

from .helpers import owner

PAIRS = [
    (corev1.SecurityContext, client.V1SecurityContext),
    (corev1.Capabilities, client.V1Capabilities),
    (corev1.SELinuxOptions, client.V1SELinuxOptions),
    (corev1.SeccompProfile, client.V1SeccompProfile),
    (corev1.AppArmorProfile, client.V1AppArmorProfile),
    (corev1.WindowsSecurityContextOptions, client.V1WindowsSecurityContextOptions),
    (corev1.EnvVarSource, client.V1EnvVarSource),
    (corev1.ConfigMapKeySelector, client.V1ConfigMapKeySelector),
    (corev1.SecretKeySelector, client.V1SecretKeySelector),
    (corev1.ObjectFieldSelector, client.V1ObjectFieldSelector),
    (corev1.ResourceFieldSelector, client.V1ResourceFieldSelector),
    (corev1.FileKeySelector, client.V1FileKeySelector),
]


def _json_fields(model: type[BaseModel]) -> dict[str, bool]:
    """JSON field name -> required."""
    return {f.serialization_alias or name: f.is_required() for name, f in model.model_fields.items()}


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_the_same_fields_as_kubernetes(ours: type[BaseModel], theirs: type[BaseModel]) -> None:
    assert _json_fields(ours) == _json_fields(theirs)


# Field names of the client's SecurityContext and EnvVarSource, misspellings of them, and values of any JSON type.
SECURITY_KEYS = [*_json_fields(client.V1SecurityContext), "runAsUSer", "readOnlyRootFilesytem", "priviledged"]
scalars = st.none() | st.booleans() | st.integers(-2, 2) | st.sampled_from(["", "0", "ALL", "RuntimeDefault"])
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(st.sampled_from(["type", "add", "drop", "user", "typo"]), inner, max_size=2)
    ),
    max_leaves=6,
)
value_from = st.dictionaries(
    st.sampled_from([*corev1.ENV_SOURCES, "fieldref"]),
    st.dictionaries(st.sampled_from(["fieldPath", "resource", "divisor", "key", "name", "optional", "x"]), scalars),
    max_size=2,
)
quantities = st.dictionaries(st.sampled_from(["cpu", "memory"]), st.integers(0, 4) | st.sampled_from(["1", "64Mi"]))


@settings(max_examples=400, deadline=None)
@given(
    security=st.none() | st.dictionaries(st.sampled_from(SECURITY_KEYS), values, max_size=4),
    source=value_from,
    limits=quantities,
)
def test_whatever_passes_our_models_the_client_sends(
    security: dict[str, Any] | None, source: dict[str, Any], limits: dict[str, Any]
) -> None:
    body = {
        "resourceName": "example.com/x",
        "image": "img",
        "securityContext": security,
        "env": [{"name": "FROM", "valueFrom": source}],
        "resources": {"limits": limits},
    }
    try:
        spec = DevicePluginConfigSpec.model_validate(body)
    except ValidationError:
        return  # the CRD's schema, generated from the same models, refuses it at `kubectl apply`
    rendered = render_daemonset(owner("x"), spec, excluded_nodes=["n1", "n2"])
    client.V1DaemonSet.model_validate(rendered)
