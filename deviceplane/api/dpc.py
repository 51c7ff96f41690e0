"""DevicePluginConfig (deviceplane.io/v1alpha1): the pydantic model its CRD is generated from (DESIGN).

Constraints the API server must enforce live here as schema keywords or CEL rules (`x-kubernetes-validations`), so
`kubectl apply` refuses a bad object with a message that says what is wrong; descriptions feed `kubectl explain`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue

from deviceplane.api.corev1 import CrdModel, EnvVarSource, Quantity, SecurityContext

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

# An extended resource name is a qualified name with a domain prefix outside kubernetes.io (as the kubelet checks:
# IsExtendedResourceName: not native, i.e. no kubernetes.io/, and no requests. prefix). CEL `matches` is RE2.
_QUALIFIED_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"  # at most 63 characters
RESOURCE_NAME_RULES: list[JsonValue] = [
    {
        "rule": f"self.matches('^{_QUALIFIED_PREFIX}/{_QUALIFIED_NAME}$')",
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

    name: str = Field(min_length=1, max_length=1024, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    valueFrom: EnvVarSource | None = Field(
        default=None, description="A core/v1 EnvVarSource (fieldRef, resourceFieldRef, configMapKeyRef, ...)."
    )


class ResourceRequirements(CrdModel):
    """CPU/memory requests and limits of the plugin container (core/v1 ResourceRequirements)."""

    limits: dict[str, Quantity] | None = Field(default=None, description="Limits, e.g. {cpu: 100m, memory: 64Mi}.")
    requests: dict[str, Quantity] | None = Field(default=None, description="Requests, e.g. {cpu: 10m}.")


class Toleration(CrdModel):
    """A core/v1 Toleration added to the plugin pods."""

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists matches all taints.")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal [Equal].")
    value: str | None = Field(default=None, description="Taint value for operator Equal.")
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
                    "rule": "type(self) == int ? self >= 1 : self.matches('^([1-9][0-9]?|100)%$')",
                    "message": "maxUnavailable must be an integer >= 1 or a percentage between 1% and 100%",
                }
            ]
        },
    )


class HostPathVolume(CrdModel):
    """An extra host directory or device mounted into the plugin container, e.g. /dev."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Volume name (DNS label), unique among the volumes.",
    )
    hostPath: str = Field(min_length=1, pattern=r"^/", description="Absolute path on the host.")
    mountPath: str = Field(min_length=1, pattern=r"^/", description="Where the container sees it.")
    readOnly: bool = Field(default=False, description="Mount read-only.")
    type: str | None = Field(default=None, description="core/v1 HostPathType, e.g. Directory, CharDevice.")


class ConfigMapRef(CrdModel):
    """A ConfigMap in the config's namespace mounted into the plugin; its content hash restarts the plugin."""

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    mountPath: str = Field(default=DEFAULT_CONFIG_MOUNT, pattern=r"^/", description="Where the container sees it.")


class DevicePluginConfigSpec(CrdModel):
    """Which device plugin to run, where, and how."""

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
    nodeSelector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a node must have to run the plugin."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the plugin pods tolerate.")
    priorityClassName: str = Field(
        default=DEFAULT_PRIORITY_CLASS,
        min_length=1,
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
        default_factory=list, max_length=32, description="Extra host paths mounted into the plugin, e.g. /dev."
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
