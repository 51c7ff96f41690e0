"""Does a live DaemonSet still carry what we rendered? (pure)

Only the fields we set are compared: what the API server or the DaemonSet controller add (defaults, status,
revision annotations) is not drift, so the operator never fights them. A hand edit of a field we own is, and so is
a hand-added pod-spec field in OWNED_POD_FIELDS, which we own even when we do not render it.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from deviceplane.operator import names

POD_SPEC_PATH = "spec.template.spec"
# Pod-spec fields that decide where the plugin runs, with which identity and which host access: ours whether or not
# the config renders them, so a hand-added one is drift. The API server defaults none of them on a pod template
# (checked against the real apiserver in tests/e2e/test_operator.py), and an empty or false value counts as absent.
OWNED_POD_FIELDS = (
    "affinity",
    "nodeSelector",
    "tolerations",
    "nodeName",
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "shareProcessNamespace",
    "initContainers",
    "serviceAccountName",
    "serviceAccount",
    "imagePullSecrets",
    "runtimeClassName",
    "hostAliases",
    "securityContext",
)


def drifted_fields(rendered: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Paths where `live` differs from what we rendered (empty: nothing to repair)."""
    out: list[str] = []
    meta, live_meta = rendered.get("metadata", {}), live.get("metadata", {})
    for field in ("labels", "annotations"):
        _compare(meta.get(field, {}), live_meta.get(field) or {}, f"metadata.{field}", out)
    owners = {r.get("uid") for r in live_meta.get("ownerReferences") or []}
    if not {r["uid"] for r in meta.get("ownerReferences", [])} <= owners:
        out.append("metadata.ownerReferences")
    _compare(rendered.get("spec", {}), live.get("spec") or {}, "spec", out)
    out += _added_pod_fields(rendered, live)
    return out


def _added_pod_fields(rendered: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Owned pod-spec fields present on the live object though we do not render them."""
    want = _pod_spec(rendered)
    have = _pod_spec(live)
    return [f"{POD_SPEC_PATH}.{k}" for k in OWNED_POD_FIELDS if k not in want and not _zero(have.get(k))]


def _pod_spec(body: Mapping[str, Any]) -> Mapping[str, Any]:
    template = (body.get("spec") or {}).get("template") or {}
    return template.get("spec") or {}


def render_hash(body: Mapping[str, Any]) -> str | None:
    annotations = body.get("metadata", {}).get("annotations") or {}
    value = annotations.get(names.RENDER_HASH_ANNOTATION)
    return str(value) if value is not None else None


def _compare(want: Any, have: Any, path: str, out: list[str]) -> None:
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            out.append(path)
            return
        for key, value in want.items():
            if key not in have:
                if not _zero(value):  # Go's omitempty drops false, 0, "" and empty collections
                    out.append(f"{path}.{key}")
            else:
                _compare(value, have[key], f"{path}.{key}", out)
    elif isinstance(want, list):
        # Lists we set are ours entirely: an item added or removed by hand is drift too.
        if not isinstance(have, list) or len(have) != len(want):
            out.append(path)
            return
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            _compare(w, h, f"{path}[{i}]", out)
    elif not _same_scalar(want, have, path):
        out.append(path)


def _zero(value: Any) -> bool:
    return (value is not True and value in (False, 0, "", None)) or value == [] or value == {}


def _same_scalar(want: Any, have: Any, path: str) -> bool:
    if want == have:
        return True
    if ".resources." in path or path.endswith(".divisor"):
        # The API server canonicalises quantities ("0.5" → "500m", "0.001" → "1m"): compare their values.
        try:
            return bool(parse_quantity(want) == parse_quantity(have))
        except (ValueError, TypeError, InvalidOperation):
            return False
    if isinstance(want, int) and not isinstance(want, bool) and isinstance(have, str):
        try:
            return Decimal(have) == want
        except InvalidOperation:
            return False
    return False
