"""DevicePluginConfig (deviceplane.io/v1alpha1): the pydantic model its CRD is generated from (DESIGN).

Constraints the API server must enforce live here as schema keywords or CEL rules (`x-kubernetes-validations`), so
`kubectl apply` refuses a bad object with a message that says what is wrong; descriptions feed `kubectl explain`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, JsonValue

from deviceplane.api.corev1 import DNS_LABEL, DNS_SUBDOMAIN, CrdModel, EnvVarSource, Quantity, SecurityContext

GROUP = "deviceplane.io"
VERSION = "v1alpha1"
KIND = "DevicePluginConfig"
PLURAL = "devicepluginconfigs"

KUBELET_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
AGENT_PLUGIN_DIR = "/var/lib/deviceplane/device-plugins"  # `deviceplane agent --plugin-dir` default
DEFAULT_PRIORITY_CLASS = "system-node-critical"
DEFAULT_CONFIG_MOUNT = "/etc/deviceplane/plugin-config"
MAX_NAME_LENGTH = 56  # the DaemonSet is <name>-plugin and the name is a label value (<= 63 characters)
MAX_CONFLICT_NODES = 20  # node names listed per conflict; nodeCount stays exact

_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"  # at most 63 characters
# What the API server checks of the pod a DaemonSet's template makes (its core/v1 pod validation), written as the
# CRD's schema, so `kubectl apply` refuses a config whose DaemonSet would be refused (before, the config was taken
# and only its status said why: tests/e2e/test_operator_fuzz.py draws specs until both agree). CEL `matches` is RE2.
_LABEL_KEY = rf"({DNS_SUBDOMAIN}/)?{_QUALIFIED_NAME}"  # a qualified name
DNS_LABEL_PATTERN = rf"^{DNS_LABEL}$"
DNS_SUBDOMAIN_PATTERN = rf"^{DNS_SUBDOMAIN}$"
LABEL_KEY_PATTERN = rf"^{_LABEL_KEY}$"
LABEL_VALUE_PATTERN = rf"^({_QUALIFIED_NAME})?$"
ENV_NAME_PATTERN = r"^[ -<>-~]+$"  # printable ASCII but '=', as the v1.36 API server words its rule
# A container's resource: a standard one (IsStandardContainerResourceName) or a qualified name with a domain.
_STANDARD_RESOURCES = "cpu|memory|ephemeral-storage|hugepages-[^/]+"
RESOURCE_KEY_PATTERN = rf"^({_STANDARD_RESOURCES}|{DNS_SUBDOMAIN}/{_QUALIFIED_NAME})$"
TOLERATION_KEY_PATTERN = rf"^({_LABEL_KEY})?$"  # a qualified name, or empty
MAX_SELECTOR_LABELS = 64  # a bound for the CEL cost estimate of the key rule
MAX_RESOURCES = 16
MAX_TOLERATIONS = 64
MAX_PATH = 1024  # a host or mount path: bounds the CEL cost of comparing every mount with every other


def cel_string(text: str) -> str:
    """`text` as a CEL string literal (a pattern for `matches`)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


RESOURCE_NAME_RULES: list[JsonValue] = [
    {
        # An extended resource name: a qualified name with a domain prefix outside kubernetes.io (as the kubelet
        # checks: IsExtendedResourceName: not native, i.e. no kubernetes.io/, and no requests. prefix).
        "rule": f"self.matches({cel_string(f'^{DNS_SUBDOMAIN}/{_QUALIFIED_NAME}$')})",
        "message": "resourceName must be an extended resource name: <domain>/<name> (name at most 63 characters), "
        "e.g. example.com/gpu",
    },
    {
        "rule": "!self.contains('kubernetes.io/') && !self.startsWith('requests.')",
        "message": "resourceName must not be in the kubernetes.io domain nor start with 'requests.'",
    },
]


class LocalObjectReference(CrdModel):
    """A reference to an object in the config's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the object.")


class EnvVar(CrdModel):
    """An environment variable of the plugin container (core/v1 EnvVar)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.valueFrom) || !has(self.value) || self.value == ''",
                    "message": "value and valueFrom exclude each other",
                }
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=1024,
        pattern=ENV_NAME_PATTERN,
        description="Variable name: printable ASCII characters but '='.",
    )
    value: str | None = Field(default=None, description="Literal value.")
    valueFrom: EnvVarSource | None = Field(
        default=None, description="A core/v1 EnvVarSource (fieldRef, resourceFieldRef, configMapKeyRef, ...)."
    )


def _resource_rules() -> list[JsonValue]:
    extended = "k.contains('/') && !k.contains('kubernetes.io/')"  # IsExtendedResourceName, the key known valid
    rules: list[JsonValue] = []
    for field in ("limits", "requests"):
        rules += [
            {
                "rule": f"!has(self.{field}) || self.{field}.all(k, k.matches({cel_string(RESOURCE_KEY_PATTERN)}))",
                "message": f"{field} names must be cpu, memory, ephemeral-storage, hugepages-<size> or <domain>/<name>",
            },
            {
                "rule": f"!has(self.{field}) || self.{field}.all(k, !({extended}) || type(self.{field}[k]) == int || "
                f"self.{field}[k].matches('^[0-9]+$'))",
                "message": f"{field} of extended resources (<domain>/<name>) must be whole numbers, written as digits",
            },
        ]
    rules.append(
        {
            "rule": f"!has(self.requests) || self.requests.all(k, !({extended}) || "
            "has(self.limits) && k in self.limits && string(self.limits[k]) == string(self.requests[k]))",
            "message": "the request of an extended resource (<domain>/<name>) must equal its limit: extended "
            "resources cannot be overcommitted",
        }
    )
    rules.append(_REQUEST_NOT_ABOVE_LIMIT)
    return rules


def _above_limit(k: str) -> str:
    """CEL: is the request of resource `k` (a name, in both maps) above its limit? isQuantity first: a value the
    CRD's pattern refuses is reported by the pattern, not as an evaluation error."""
    request, limit = f"string(self.requests[{k}])", f"string(self.limits[{k}])"
    return (
        f"{k} in self.limits && isQuantity({request}) && isQuantity({limit}) && "
        f"quantity({request}).compareTo(quantity({limit})) > 0"
    )


# The message names the first of the standard resources whose request is above its limit, with both quantities, as
# the API server's own pod validation does. Only these, from a literal list: a map key is a string of unbounded
# length to the API server's cost estimate, and a message built by joining a list was refused as over 100 times the
# CRD's budget (measured, v1.36). hugepages-<size> gets the plain message (an extended resource is refused as
# unequal anyway).
_NAMED_ABOVE = f"['cpu', 'memory', 'ephemeral-storage'].filter(r, r in self.requests && {_above_limit('r')})"
_PLAIN = "a request must be less than or equal to its limit for the same resource"

# A request above its limit for the same resource: the API server refuses the pod (and so the DaemonSet) with
# `must be less than or equal to <r> limit of <q>`. Comparing two quantities needs Kubernetes' quantity CEL library
# (tried with the tests' v1.36 API server). Both maps hold at most MAX_RESOURCES entries: the cost is bounded.
_REQUEST_NOT_ABOVE_LIMIT: JsonValue = {
    "rule": f"!has(self.requests) || !has(self.limits) || !self.requests.exists(k, {_above_limit('k')})",
    "fieldPath": ".requests",
    "messageExpression": f"{_NAMED_ABOVE}.size() == 0 ? '{_PLAIN}' : {_NAMED_ABOVE}.map(r, 'requests.' + r + ' (' + "
    "string(self.requests[r]) + ') must be less than or equal to limits.' + r + ' (' + string(self.limits[r]) + "
    "')')[0]",
    "message": _PLAIN,
}


class ResourceRequirements(CrdModel):
    """CPU/memory requests and limits of the plugin container (core/v1 ResourceRequirements)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _resource_rules()})

    limits: dict[str, Quantity] | None = Field(
        default=None, max_length=MAX_RESOURCES, description="Limits, e.g. {cpu: 100m, memory: 64Mi}."
    )
    requests: dict[str, Quantity] | None = Field(
        default=None, max_length=MAX_RESOURCES, description="Requests, e.g. {cpu: 10m}."
    )


_TOLERATION_RULES: list[JsonValue] = [
    {
        "rule": "has(self.key) && self.key != '' || has(self.operator) && self.operator == 'Exists'",
        "message": "operator must be Exists when key is empty (a toleration of every taint)",
    },
    {
        "rule": "!(has(self.operator) && self.operator == 'Exists') || !has(self.value) || self.value == ''",
        "message": "value must be empty when operator is Exists",
    },
    {
        "rule": "!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
        "message": "effect must be NoExecute when tolerationSeconds is set",
    },
]


class Toleration(CrdModel):
    """A core/v1 Toleration added to the plugin pods."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _TOLERATION_RULES})

    key: str | None = Field(
        default=None,
        max_length=317,
        pattern=TOLERATION_KEY_PATTERN,
        description="Taint key (a label key); empty with operator Exists matches all taints.",
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal [Equal].")
    value: str | None = Field(
        default=None, pattern=LABEL_VALUE_PATTERN, description="Taint value (a label value) for operator Equal."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    tolerationSeconds: int | None = Field(default=None, description="For NoExecute: how long the pod stays bound.")


class UpdateStrategy(CrdModel):
    """How the plugin DaemonSet replaces its pods."""

    type: Literal["RollingUpdate", "OnDelete"] = Field(
        default="RollingUpdate", description="RollingUpdate (replace pods on change) or OnDelete."
    )
    maxUnavailable: int | str = Field(
        default=1,
        description="RollingUpdate: pods that may be unavailable during an update, a number >= 1 or a percentage.",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # At most int32's maximum: the DaemonSet's field is an int32, and a larger number was taken here
                    # and then refused in the DaemonSet (cannot unmarshal ... of type int32; test_operator_fuzz.py).
                    "rule": "type(self) == int ? self >= 1 && self <= 2147483647 : "
                    "self.matches('^([1-9][0-9]?|100)%$')",
                    "message": "maxUnavailable must be an integer from 1 to 2147483647 or a percentage between 1% "
                    "and 100%",
                }
            ]
        },
    )


HostPathType = Literal[
    "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"
]
REGISTRATION_VOLUME = "device-plugins"  # the plugin pods' volumes of the operator's own (operator/render.py)
CONFIG_VOLUME = "plugin-config"
OWN_VOLUMES = (REGISTRATION_VOLUME, CONFIG_VOLUME)
_VOLUME_RULES: list[JsonValue] = [
    {
        "rule": f"!(self.name in {list(OWN_VOLUMES)})",
        "message": f"volume names {' and '.join(OWN_VOLUMES)} are the operator's own",
    },
    {"rule": "!self.hostPath.matches('(^|/)[.][.](/|$)')", "message": "hostPath must not contain '..'"},
]


class HostPathVolume(CrdModel):
    """An extra host directory or device mounted into the plugin container, e.g. /dev."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _VOLUME_RULES})

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="Volume name (DNS label), unique among the volumes.",
    )
    hostPath: str = Field(min_length=1, max_length=MAX_PATH, pattern=r"^/", description="Absolute path on the host.")
    mountPath: str = Field(min_length=1, max_length=MAX_PATH, pattern=r"^/", description="Where the container sees it.")
    readOnly: bool = Field(default=False, description="Mount read-only.")
    type: HostPathType | None = Field(
        default=None, description="core/v1 HostPathType, e.g. Directory, CharDevice (empty: no check)."
    )


class ConfigMapRef(CrdModel):
    """A ConfigMap in the config's namespace mounted into the plugin; its content hash restarts the plugin."""

    # A name the API server cannot take was sent in the operator's list by name, refused (400), and the config was
    # left without a status.
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="ConfigMap name.")
    mountPath: str = Field(
        default=DEFAULT_CONFIG_MOUNT, max_length=MAX_PATH, pattern=r"^/", description="Where the container sees it."
    )


# Each mount of the plugin container needs a path of its own (the API server refuses a pod with two at one path).
_MOUNT_RULES: list[JsonValue] = [
    {
        "rule": "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.mountPath == v.mountPath))",
        "message": "volumes must have different mountPaths",
    },
    {
        "rule": f"!has(self.volumes) || self.volumes.all(v, v.mountPath != '{KUBELET_PLUGIN_DIR}')",
        "message": f"a volume's mountPath must not be {KUBELET_PLUGIN_DIR}, where the registration directory goes",
    },
    {
        "rule": f"!has(self.configMapRef) || self.configMapRef.mountPath != '{KUBELET_PLUGIN_DIR}' && "
        "(!has(self.volumes) || self.volumes.all(v, v.mountPath != self.configMapRef.mountPath))",
        "message": "configMapRef.mountPath must differ from the volumes' mountPaths and from "
        f"{KUBELET_PLUGIN_DIR}, where the registration directory is mounted",
    },
]


class DevicePluginConfigSpec(CrdModel):
    """Which device plugin to run, where, and how."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _MOUNT_RULES})

    resourceName: str = Field(
        min_length=3,
        max_length=317,
        description="The extended resource the plugin serves (<domain>/<name>); used to detect two configs "
        "serving one resource on the same node. It is not passed to the plugin: give the plugin its resource in "
        "args or env as the plugin expects, and change both together.",
        json_schema_extra={"x-kubernetes-validations": RESOURCE_NAME_RULES},
    )
    image: str = Field(
        min_length=1,
        max_length=1024,
        description="Container image of the plugin.",
        json_schema_extra={
            "x-kubernetes-validations": [{"rule": "self.trim() != ''", "message": "image must not be empty"}]
        },
    )
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Always, IfNotPresent or Never (Kubernetes' default when empty)."
    )
    imagePullSecrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the image."
    )
    command: list[str] | None = Field(default=None, description="Container entrypoint (the image's when empty).")
    args: list[str] = Field(default_factory=list, description="Arguments of the plugin.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=1024,  # a bound, so the API server's cost estimate of the valueFrom rule fits its budget
        description="Extra environment. NODE_NAME is always set to the pod's node (downward API); an entry named "
        "NODE_NAME here is ignored.",
    )
    resources: ResourceRequirements | None = Field(default=None, description="CPU/memory of the plugin container.")
    nodeSelector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] = Field(
        default_factory=dict,
        max_length=MAX_SELECTOR_LABELS,
        description="Node labels a node must have to run the plugin.",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k.matches({cel_string(LABEL_KEY_PATTERN)}))",
                    "message": "nodeSelector keys must be label keys: [<DNS subdomain>/]<name>, the name at most 63 "
                    "characters of alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric",
                }
            ]
        },
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=MAX_TOLERATIONS, description="Taints the plugin pods tolerate."
    )
    priorityClassName: str = Field(
        default=DEFAULT_PRIORITY_CLASS,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Priority class of the plugin pods, so they are not evicted before the workloads they serve.",
    )
    updateStrategy: UpdateStrategy = Field(
        default_factory=UpdateStrategy,
        description="How the DaemonSet rolls out a change.",
        json_schema_extra={"default": {}},  # the API server then fills in the nested defaults
    )
    target: Literal["kubelet", "agent"] = Field(
        default="kubelet",
        description="Whom the plugin registers with: kubelet mounts the host's /var/lib/kubelet/device-plugins, "
        f"agent mounts the deviceplane agent's {AGENT_PLUGIN_DIR}; the container always sees "
        f"{KUBELET_PLUGIN_DIR}.",
    )
    volumes: list[HostPathVolume] = Field(
        default_factory=list,
        max_length=32,
        description="Extra host paths mounted into the plugin, e.g. /dev.",
        # Names unique: the API server refuses a second volume of one name when the config is written.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    configMapRef: ConfigMapRef | None = Field(
        default=None, description="A ConfigMap mounted into the plugin; changing its content restarts the plugin."
    )
    securityContext: SecurityContext | None = Field(
        default=None,
        description="A core/v1 SecurityContext replacing the secure default as a whole (no privilege escalation, "
        "read-only root filesystem, all capabilities dropped, seccomp profile RuntimeDefault); e.g. "
        "{privileged: true} for plugins that need it.",
    )
    paused: bool = Field(default=False, description="Stop changing the DaemonSet (status is still reported).")


class ConflictView(CrdModel):
    """Another config serving the same resource on some of the same nodes."""

    config: str = Field(description="The other config, <namespace>/<name>.")
    owner: bool = Field(
        description="True when this config keeps the shared nodes (the older, unless its DaemonSet could not be "
        "created while the other's runs), false when it yields them."
    )
    nodes: list[str] = Field(
        default_factory=list, max_length=MAX_CONFLICT_NODES, description="Shared nodes (bounded, see nodeCount)."
    )
    nodeCount: int = Field(description="How many nodes are shared (exact).")


class ConditionView(CrdModel):
    """A Kubernetes-style condition."""

    type: Literal["Ready", "Progressing", "Degraded", "Conflict"] = Field(description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="What is going on, naming the cause.")
    lastTransitionTime: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observedGeneration: int | None = Field(default=None, description="The spec generation this was computed for.")


class DevicePluginConfigStatus(CrdModel):
    """The plugin DaemonSet's rollout and any conflict with other configs."""

    observedGeneration: int | None = Field(default=None, description="The spec generation last acted on.")
    daemonSet: str | None = Field(default=None, description="Name of the plugin DaemonSet (same namespace).")
    desiredNumberScheduled: int = Field(default=0, description="Nodes that should run the plugin.")
    numberReady: int = Field(default=0, description="Nodes whose plugin pod is ready.")
    updatedNumberScheduled: int = Field(default=0, description="Nodes running the current pod template.")
    numberAvailable: int = Field(default=0, description="Nodes whose plugin pod is available.")
    conflicts: list[ConflictView] = Field(
        default_factory=list, description="Other configs serving this resource on shared nodes."
    )
    conditions: list[ConditionView] = Field(
        default_factory=list, description="Ready, Progressing, Degraded and Conflict."
    )
