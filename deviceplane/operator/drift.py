"""Does a live DaemonSet still carry what we rendered? (pure)

Only the fields we set are compared: what the API server or the DaemonSet controller add (defaults, status,
revision annotations) is not drift, so the operator never fights them. A hand edit of a field we own is, and so is
a hand-added pod-spec field in OWNED_POD_FIELDS or container field in OWNED_CONTAINER_FIELDS, which we own even
when we do not render them, and any field added to the container's securityContext.
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

# Container fields that change what runs in the plugin container, or with which access: ours whether or not the
# config renders them (the API server defaults none of them on a pod template; it adds imagePullPolicy,
# terminationMessagePath/Policy and an empty resources, which are not here).
OWNED_CONTAINER_FIELDS = (
    "command",
    "args",
    "workingDir",
    "env",
    "envFrom",
    "volumeMounts",
    "volumeDevices",
    "ports",
    "resources",
    "securityContext",
    "lifecycle",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "restartPolicy",
    "stdin",
    "tty",
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
    out += _added_fields(rendered, live)
    return out


def _added_fields(rendered: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """Owned pod-spec and container fields present on the live object though we do not render them, and fields
    added to a container's securityContext (the API server adds none there: each one is a hand edit)."""
    want, have = _pod_spec(rendered), _pod_spec(live)
    out = [f"{POD_SPEC_PATH}.{k}" for k in OWNED_POD_FIELDS if k not in want and _set(have.get(k))]
    live_containers = have.get("containers") or []
    for i, container in enumerate(want.get("containers") or []):
        if i >= len(live_containers) or not isinstance(live_containers[i], Mapping):
            continue  # a list of another length is drift already
        path, live_container = f"{POD_SPEC_PATH}.containers[{i}]", live_containers[i]
        out += [f"{path}.{k}" for k in OWNED_CONTAINER_FIELDS if k not in container and _set(live_container.get(k))]
        if "securityContext" in container:
            _added_keys(
                container["securityContext"], live_container.get("securityContext"), f"{path}.securityContext", out
            )
    return out


def _added_keys(want: Any, have: Any, path: str, out: list[str]) -> None:
    if not isinstance(want, Mapping) or not isinstance(have, Mapping):
        return  # a different type is drift already
    for key, value in have.items():
        if key not in want:
            if _set(value):
                out.append(f"{path}.{key}")
        else:
            _added_keys(want[key], value, f"{path}.{key}", out)


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
                if not _omitted_when_empty(value):
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


def _omitted_when_empty(value: Any) -> bool:
    """Would the API server store this rendered value as absent?

    Go's omitempty drops "" and empty lists and maps of non-pointer fields, and so does the API server. It keeps
    false and 0 in pointer fields, and every boolean and integer we render is one (automountServiceAccountToken,
    the securityContext's, env valueFrom's `optional`, tolerationSeconds, maxUnavailable; volumeMounts' readOnly,
    which is not, is rendered only when true): a hand-removed `automountServiceAccountToken: false` or
    `runAsUser: 0` is drift, not a default.
    """
    return value is None or (isinstance(value, (str, list, dict)) and len(value) == 0)


def _set(value: Any) -> bool:
    """Is a field we do not render set on the live object? Empty and false values count as unset: the API server
    defaults the pod securityContext to {}, and false host namespaces mean what absent ones do."""
    return not (value is None or value is False or _omitted_when_empty(value))


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
