"""The part of a Pod the device manager needs, parsed from a Pod object (dict) with clear validation errors.

A malformed pod must never crash anything: `parse_pod` raises `PodError` with a message meant for a person, and the
caller records it. Only extended resources are interpreted; CPU, memory and the like are ignored (their quantities
are not validated here, the device manager does not own them).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from deviceplane.core.constants import INT64_MAX
from deviceplane.core.names import is_extended_resource_name

PHASE_PENDING = "Pending"
PHASE_RUNNING = "Running"
PHASE_SUCCEEDED = "Succeeded"
PHASE_FAILED = "Failed"
PHASES = (PHASE_PENDING, PHASE_RUNNING, PHASE_SUCCEEDED, PHASE_FAILED, "Unknown")
TERMINAL_PHASES = (PHASE_SUCCEEDED, PHASE_FAILED)
DEFAULT_NAMESPACE = "default"
CONTAINER_RESTART_ALWAYS = "Always"
CONTAINER_RESTART_POLICIES = (CONTAINER_RESTART_ALWAYS, "OnFailure", "Never")

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# apimachinery's `resource.Quantity`: a signed decimal number, then a binary-SI or decimal-SI suffix or an exponent.
_QUANTITY = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?[0-9]+))?")
# Suffix -> the power of ten (decimal SI) or of two (binary SI) it multiplies by.
_DECIMAL_SUFFIXES = {None: 0, "n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_SCALE: dict[str | None, Fraction] = {
    **{suffix: Fraction(10) ** power for suffix, power in _DECIMAL_SUFFIXES.items()},
    **{suffix: Fraction(2**power) for suffix, power in _BINARY_SUFFIXES.items()},
}
# int64 has 19 digits: a longer number counts no devices (and int() of thousands of digits fails), and an exponent
# past 40 puts any non-zero value far above int64 or below a thousandth.
_QUANTITY_DIGITS_LIMIT = 40
_QUANTITY_EXPONENT_LIMIT = 40
_NOT_WHOLE = "extended resources must be whole numbers"


class PodError(ValueError):
    """The pod object is not one the agent can admit; the message says why."""


@dataclass(frozen=True, slots=True)
class Container:
    name: str
    # Extended-resource limits (requests equal them: extended resources cannot be overcommitted), in spec order.
    limits: tuple[tuple[str, int], ...] = ()
    init: bool = False
    # An init container with `restartPolicy: Always` (a sidecar) keeps its devices for the pod's lifetime.
    restartable: bool = False

    @property
    def kind(self) -> str:
        if not self.init:
            return "app"
        return "sidecar" if self.restartable else "init"


@dataclass(frozen=True, slots=True)
class Pod:
    uid: str
    namespace: str
    name: str
    phase: str
    init_containers: tuple[Container, ...]
    containers: tuple[Container, ...]

    @property
    def all_containers(self) -> tuple[Container, ...]:
        """Admission order: init containers first, then app containers (spec §4.7.1)."""
        return self.init_containers + self.containers

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def device_requests(self) -> dict[str, int]:
        """Every extended resource any container asks for (a non-zero limit), with the largest single request."""
        wanted: dict[str, int] = {}
        for container in self.all_containers:
            for resource, count in container.limits:
                if count > 0:
                    wanted[resource] = max(wanted.get(resource, 0), count)
        return wanted


def parse_quantity(value: Any, where: str) -> int:
    """An extended-resource quantity as a count: 2, "2", "1k", "1Ki", and what the API server accepts as whole,
    "1000m", "2.0", "1e3" (its check: the value in thousandths, rounded up, is a multiple of 1000). "500m", "0.5" and
    negative values are refused, as are counts beyond int64."""
    if isinstance(value, bool):
        raise PodError(f"{where}: invalid quantity {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        number = _string_quantity(value, where)
    else:
        raise PodError(f"{where}: invalid quantity {_shown(value)}: {_NOT_WHOLE}")
    if number < 0:
        raise PodError(f"{where}: must be greater than or equal to 0")
    if number > INT64_MAX:
        raise PodError(f"{where}: invalid quantity {_shown(value)}: too large")
    return number


def _string_quantity(text: str, where: str) -> int:
    if text.isascii() and text.isdigit() and len(text) <= 18:  # the usual "2": 0.3 instead of ~4 us (timeit)
        return int(text)
    match = _QUANTITY.fullmatch(text.strip())  # JSON's Quantity decoding trims spaces too
    if match is None or not (match.group(2) or match.group(3)):
        raise PodError(f"{where}: invalid quantity {_shown(text)}")
    sign, whole, fraction, suffix, exponent_text = match.groups()
    whole, fraction = whole.lstrip("0"), (fraction or "").rstrip("0")
    if len(whole) + len(fraction) > _QUANTITY_DIGITS_LIMIT:
        raise PodError(f"{where}: invalid quantity {_shown(text)}: too many digits")
    value = Fraction(int(whole + fraction or "0"), 10 ** len(fraction))
    if exponent_text is None:
        value *= _SUFFIX_SCALE[suffix]
    elif value:
        exponent = int(exponent_text)
        if exponent > _QUANTITY_EXPONENT_LIMIT:
            raise PodError(f"{where}: invalid quantity {_shown(text)}: too large")
        if exponent < -_QUANTITY_EXPONENT_LIMIT:  # under 10^40 x 10^-41: a non-zero value under a tenth
            raise PodError(f"{where}: invalid quantity {_shown(text)}: {_NOT_WHOLE}")
        value *= Fraction(10) ** exponent
    if sign == "-" and value:
        raise PodError(f"{where}: must be greater than or equal to 0")
    thousandths = math.ceil(value * 1000)
    if thousandths % 1000:
        raise PodError(f"{where}: invalid quantity {_shown(text)}: {_NOT_WHOLE}")
    return thousandths // 1000


def _shown(value: Any, limit: int = 40) -> str:
    """A value for an error message, shortened: pod files and API objects may carry megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _string(value: Any, where: str, required: bool = True) -> str:
    if value is None or value == "":
        if required:
            raise PodError(f"{where}: Required value")
        return ""
    if not isinstance(value, str):
        raise PodError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _parse_limits(resources: Mapping[str, Any], where: str) -> tuple[tuple[str, int], ...]:
    limits = _mapping(resources.get("limits"), f"{where}.limits")
    requests = _mapping(resources.get("requests"), f"{where}.requests")
    parsed: dict[str, int] = {}
    for name, raw in limits.items():
        if is_extended_resource_name(str(name)):
            parsed[str(name)] = parse_quantity(raw, f"{where}.limits[{name}]")
    for name, raw in requests.items():
        if not is_extended_resource_name(str(name)):
            continue
        request = parse_quantity(raw, f"{where}.requests[{name}]")
        # Apiserver validation: extended resources cannot be overcommitted.
        if name not in parsed:
            raise PodError(
                f"{where}.limits[{name}]: Required value: Limit must be set for non overcommitable resources"
            )
        if parsed[name] != request:
            raise PodError(f"{where}.requests[{name}]: Invalid value: {raw!r}: must be equal to {name} limit")
    return tuple(parsed.items())


def _restart_policy(spec: Mapping[str, Any], where: str) -> str:
    """A container's `restartPolicy` ("" when unset), validated as the API server does (v1.36 ContainerRestartRules:
    any container may set it, with `restartPolicyRules`). The rules themselves do not change device allocation."""
    policy = spec.get("restartPolicy")
    if policy is None:
        policy = ""
    elif not isinstance(policy, str):
        raise PodError(f"{where}.restartPolicy: expected a string, got {type(policy).__name__}")
    elif policy not in CONTAINER_RESTART_POLICIES:
        raise PodError(f"{where}.restartPolicy: Unsupported value: {policy!r}")
    rules = spec.get("restartPolicyRules")
    if rules is not None and not isinstance(rules, list):
        raise PodError(f"{where}.restartPolicyRules: expected a list, got {type(rules).__name__}")
    if rules and not policy:
        raise PodError(f"{where}.restartPolicy: Required value: must specify restartPolicy when restart rules are used")
    return policy


def _parse_containers(value: Any, where: str, init: bool, seen: set[str]) -> tuple[Container, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise PodError(f"{where}: expected a list, got {type(value).__name__}")
    out = []
    for index, raw in enumerate(value):
        here = f"{where}[{index}]"
        spec = _mapping(raw, here)
        name = _string(spec.get("name"), f"{here}.name")
        if not _DNS1123_LABEL.fullmatch(name) or len(name) > 63:
            raise PodError(f"{here}.name: Invalid value: {name!r}: must be a DNS-1123 label")
        if name in seen:
            raise PodError(f"{here}.name: Duplicate value: {name!r}")
        seen.add(name)
        restart_policy = _restart_policy(spec, here)
        limits = _parse_limits(_mapping(spec.get("resources"), f"{here}.resources"), f"{here}.resources")
        # Upstream IsRestartableInitContainer: only an init container with `Always` is a sidecar.
        restartable = init and restart_policy == CONTAINER_RESTART_ALWAYS
        out.append(Container(name=name, limits=limits, init=init, restartable=restartable))
    return tuple(out)


def stable_uid(obj: Mapping[str, Any], node_name: str, source: str) -> str:
    """A UID for a pod without `metadata.uid`, as the kubelet gives static pods one: a hash of the pod's content,
    the node name and the file it came from. Canonical JSON, so reformatting a file does not change it."""
    digest = hashlib.sha256()
    canonical = json.dumps(_json_shaped(obj), sort_keys=True, separators=(",", ":"), default=str)
    digest.update(canonical.encode())
    digest.update(f"host:{node_name}".encode())
    digest.update(f"file:{source}".encode(errors="surrogateescape"))  # a file name's own bytes, UTF-8 or not
    return digest.hexdigest()[:32]


def _json_key(key: object) -> str:
    """A YAML mapping key as the kubelet's YAML-to-JSON conversion spells it (`1` -> "1", `true` -> "true")."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return json.dumps(key)
    return str(key)


def _json_shaped(value: object) -> object:
    """`value` with string keys only and sets as sorted lists: YAML allows `{1: a, b: c}` (which `sort_keys` cannot
    order) and `!!set`. A document that is already JSON-shaped comes out equal, so its UID does not change."""
    if isinstance(value, Mapping):
        return {_json_key(k): _json_shaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_shaped(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_json_shaped(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True, default=str))
    return value


def parse_pod(obj: Any, node_name: str = "", source: str = "") -> Pod:
    """A Pod from its object form (a decoded YAML/JSON document). Raises PodError with what is wrong."""
    if not isinstance(obj, Mapping):
        raise PodError(f"expected a Pod object, got {type(obj).__name__}")
    kind = obj.get("kind", "Pod")
    if kind != "Pod":
        raise PodError(f"kind: expected Pod, got {kind!r}")
    api_version = obj.get("apiVersion", "v1")
    if api_version != "v1":
        raise PodError(f"apiVersion: expected v1, got {api_version!r}")
    metadata = _mapping(obj.get("metadata"), "metadata")
    name = _string(metadata.get("name"), "metadata.name")
    if not _DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        raise PodError(f"metadata.name: Invalid value: {name!r}: must be a DNS-1123 subdomain")
    namespace = _string(metadata.get("namespace"), "metadata.namespace", required=False) or DEFAULT_NAMESPACE
    if not _DNS1123_LABEL.fullmatch(namespace) or len(namespace) > 63:
        raise PodError(f"metadata.namespace: Invalid value: {namespace!r}: must be a DNS-1123 label")
    uid = _string(metadata.get("uid"), "metadata.uid", required=False) or stable_uid(obj, node_name, source)
    spec = _mapping(obj.get("spec"), "spec")
    seen: set[str] = set()
    init_containers = _parse_containers(spec.get("initContainers"), "spec.initContainers", True, seen)
    containers = _parse_containers(spec.get("containers"), "spec.containers", False, seen)
    if not containers:
        raise PodError("spec.containers: Required value")
    status = _mapping(obj.get("status"), "status")
    phase = _string(status.get("phase"), "status.phase", required=False) or PHASE_PENDING
    if phase not in PHASES:
        raise PodError(f"status.phase: Unsupported value: {phase!r}")
    return Pod(uid, namespace, name, phase, init_containers, containers)
