"""The core/v1 types a DevicePluginConfig embeds: the container SecurityContext and EnvVarSource (pydantic).

Same field names and types as Kubernetes' own (tests/unit/operator/test_corev1.py compares them with the official
client's models), so the CRD generated from them gives these fields a real schema: the API server refuses a
misspelt field (`kubectl apply`: `unknown field "spec.securityContext.runAsUSer"`) or a wrong type when the config
is written. With a free-form schema they were stored as written, and the DaemonSet could then not be sent (the
Kubernetes client checks bodies against its models) or was refused by the API server, long after `kubectl apply`
had said yes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, PlainSerializer


class CrdModel(BaseModel):
    """Field names are the JSON names (camelCase); unknown fields of a stored object are ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# A resource.Quantity: the CRD takes an integer or a string (`cpu: 1`, `memory: 64Mi`), the API server reads both
# alike, but the Kubernetes client refuses an integer quantity before sending it, so a dump is always a string. Not
# negative (a container's resources and a divisor may not be), and a string in the form the API server parses
# (controller-gen's pattern for resource.Quantity, without the sign): one it cannot parse was taken in the config and
# then refused in the DaemonSet ("quantities must match the regular expression ..."). 64 characters bound the CEL
# rules' cost over them (dpc.ResourceRequirements).
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, Field(max_length=64, pattern=QUANTITY_PATTERN)],
    PlainSerializer(str, return_type=str),
]
MAX_ID = 2_147_483_647  # a UID or GID: the API server takes 0 to 2^31 - 1
PLUGIN_CONTAINER_NAME = "plugin"  # the one container of the operator's plugin pods (operator/render.py)

ProfileType = Literal["RuntimeDefault", "Unconfined", "Localhost"]


Capability = Annotated[str, Field(max_length=64)]  # bounds the CEL cost of SecurityContext's rules


class Capabilities(CrdModel):
    """Linux capabilities added to or dropped from the container's default set."""

    add: list[Capability] | None = Field(
        default=None, max_length=64, description="Capabilities to add, e.g. SYS_ADMIN."
    )
    drop: list[Capability] | None = Field(default=None, max_length=64, description="Capabilities to drop, e.g. ALL.")


class SELinuxOptions(CrdModel):
    """The SELinux context of the container."""

    level: str | None = Field(default=None, description="SELinux level label.")
    role: str | None = Field(default=None, description="SELinux role label.")
    type: str | None = Field(default=None, description="SELinux type label.")
    user: str | None = Field(default=None, description="SELinux user label.")


# A profile's localhostProfile goes with type Localhost only (the API server refuses the pod otherwise).
_LOCALHOST_PROFILE: list[JsonValue] = [
    {
        "rule": "self.type == 'Localhost' ? has(self.localhostProfile) && self.localhostProfile != '' : "
        "!has(self.localhostProfile)",
        "message": "localhostProfile is required with type Localhost and not allowed with any other type",
    }
]


class SeccompProfile(CrdModel):
    """The container's seccomp profile."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _LOCALHOST_PROFILE})

    type: ProfileType = Field(description="RuntimeDefault, Unconfined or Localhost.")
    localhostProfile: str | None = Field(
        default=None, description="With type Localhost: the profile's path, relative to the kubelet's seccomp dir."
    )


class AppArmorProfile(CrdModel):
    """The container's AppArmor profile."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _LOCALHOST_PROFILE})

    type: ProfileType = Field(description="RuntimeDefault, Unconfined or Localhost.")
    localhostProfile: str | None = Field(
        default=None, description="With type Localhost: the name of a profile loaded on the node."
    )


class WindowsSecurityContextOptions(CrdModel):
    """Windows-specific options."""

    gmsaCredentialSpec: str | None = Field(default=None, description="The GMSA credential spec's content.")
    gmsaCredentialSpecName: str | None = Field(default=None, description="The GMSA credential spec's name.")
    hostProcess: bool | None = Field(default=None, description="Run as a Windows HostProcess container.")
    runAsUserName: str | None = Field(default=None, description="The user name the entrypoint runs as.")


_NO_ESCALATION = "has(self.allowPrivilegeEscalation) && !self.allowPrivilegeEscalation"
_SECURITY_RULES: list[JsonValue] = [
    {
        # The plugin pods run in the host's user namespace (no `hostUsers: false`), where Unmasked is refused.
        "rule": "!has(self.procMount) || self.procMount == 'Default'",
        "message": "procMount Unmasked needs the pod's hostUsers false, which plugin pods do not set",
    },
    {
        "rule": f"!({_NO_ESCALATION} && has(self.privileged) && self.privileged)",
        "message": "allowPrivilegeEscalation false and privileged true exclude each other",
    },
    {
        "rule": f"!({_NO_ESCALATION} && has(self.capabilities) && has(self.capabilities.add) && "
        "self.capabilities.add.exists(c, c == 'SYS_ADMIN' || c == 'CAP_SYS_ADMIN'))",
        "message": "allowPrivilegeEscalation false and capabilities.add SYS_ADMIN exclude each other",
    },
]


class SecurityContext(CrdModel):
    """A core/v1 SecurityContext of the plugin container."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _SECURITY_RULES})

    allowPrivilegeEscalation: bool | None = Field(
        default=None, description="Whether a process can gain more privileges than its parent (no_new_privs)."
    )
    appArmorProfile: AppArmorProfile | None = Field(default=None, description="The AppArmor profile.")
    capabilities: Capabilities | None = Field(default=None, description="Capabilities added or dropped.")
    privileged: bool | None = Field(default=None, description="Run privileged (as root on the host).")
    procMount: Literal["Default", "Unmasked"] | None = Field(default=None, description="Default or Unmasked.")
    readOnlyRootFilesystem: bool | None = Field(default=None, description="Mount the root filesystem read-only.")
    runAsGroup: int | None = Field(default=None, ge=0, le=MAX_ID, description="GID of the entrypoint.")
    runAsNonRoot: bool | None = Field(default=None, description="Refuse to start as UID 0.")
    runAsUser: int | None = Field(
        default=None, ge=0, le=MAX_ID, description="UID of the entrypoint (the image's when unset)."
    )
    seLinuxOptions: SELinuxOptions | None = Field(default=None, description="The SELinux context.")
    seccompProfile: SeccompProfile | None = Field(default=None, description="The seccomp profile.")
    windowsOptions: WindowsSecurityContextOptions | None = Field(default=None, description="Windows options.")


# What the API server checks of an env key selector (validateConfigMapKeySelector, validateSecretKeySelector): the
# name a DNS subdomain, the key a ConfigMap key (IsConfigMapKey: at most 253 of [-._a-zA-Z0-9], not '.', '..' nor
# starting with '..'). Taken in the config before, then refused in the DaemonSet (test_operator_fuzz.py). `name` stays
# optional in the schema, as in the Kubernetes client's models (test_corev1.py compares them): a rule requires it.
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{DNS_LABEL}(\.{DNS_LABEL})*"
_KEY_SELECTOR_RULES: list[JsonValue] = [
    {"rule": "has(self.name)", "message": "name is required: the object in the config's namespace to read"},
    {"rule": "self.key != '.' && !self.key.startsWith('..')", "message": "key must not be '.' nor start with '..'"},
]


def _selector_name(kind: str) -> Any:
    return Field(default=None, max_length=253, pattern=rf"^{DNS_SUBDOMAIN}$", description=f"The {kind}'s name.")


def _selector_key() -> Any:
    return Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key.")


class ConfigMapKeySelector(CrdModel):
    """A key of a ConfigMap in the config's namespace."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _KEY_SELECTOR_RULES})

    key: str = _selector_key()
    name: str | None = _selector_name("ConfigMap")
    optional: bool | None = Field(default=None, description="Whether the ConfigMap or its key may be missing.")


class SecretKeySelector(CrdModel):
    """A key of a Secret in the config's namespace."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _KEY_SELECTOR_RULES})

    key: str = _selector_key()
    name: str | None = _selector_name("Secret")
    optional: bool | None = Field(default=None, description="Whether the Secret or its key may be missing.")


# The pod fields an environment variable may read (the API server's validEnvDownwardAPIFieldPathExpressions).
ENV_FIELD_PATH_PATTERN = (
    r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])|spec\.(nodeName|serviceAccountName)"
    r"|status\.(hostIP|hostIPs|podIP|podIPs))$"
)


class ObjectFieldSelector(CrdModel):
    """A field of the pod (downward API)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.apiVersion) || self.apiVersion == 'v1'", "message": "apiVersion must be v1"}
            ]
        }
    )

    fieldPath: str = Field(
        pattern=ENV_FIELD_PATH_PATTERN,
        description="The field: metadata.name, metadata.namespace, metadata.uid, metadata.labels['<key>'], "
        "metadata.annotations['<key>'], spec.nodeName, spec.serviceAccountName, status.hostIP(s) or status.podIP(s).",
    )
    apiVersion: str | None = Field(default=None, description="Schema version fieldPath is written in [v1].")


_CPU_DIVISORS = ["1m", "1"]
_BYTE_DIVISORS = ["1", "1k", "1M", "1G", "1T", "1P", "1E", "1Ki", "1Mi", "1Gi", "1Ti", "1Pi", "1Ei"]
_DIVISOR_RULES: list[JsonValue] = [
    {
        "rule": f"!has(self.divisor) || !self.resource.endsWith('.cpu') || string(self.divisor) in {_CPU_DIVISORS}",
        "message": f"the divisor of a cpu resource must be one of {', '.join(_CPU_DIVISORS)}",
    },
    {
        "rule": f"!has(self.divisor) || self.resource.endsWith('.cpu') || string(self.divisor) in {_BYTE_DIVISORS}",
        "message": f"the divisor of a memory, ephemeral-storage or hugepages resource must be one of "
        f"{', '.join(_BYTE_DIVISORS)}",
    },
    {
        "rule": "!has(self.containerName) || self.containerName == '' || "
        f"self.containerName == '{PLUGIN_CONTAINER_NAME}'",
        "message": f"containerName must be {PLUGIN_CONTAINER_NAME}, the plugin pods' one container (or empty)",
    },
]


class ResourceFieldSelector(CrdModel):
    """A resource limit or request of a container (downward API)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _DIVISOR_RULES})

    resource: str = Field(
        max_length=128,
        pattern=r"^(limits|requests)\.(cpu|memory|ephemeral-storage|hugepages-.+)$",
        description="limits.<r> or requests.<r> of cpu, memory, ephemeral-storage or hugepages-<size>.",
    )
    containerName: str | None = Field(default=None, description="The container [this one].")
    divisor: Quantity | None = Field(default=None, description="The quantity the value is divided by [1].")


class FileKeySelector(CrdModel):
    """A key of an env file in one of the pod's emptyDir volumes."""

    volumeName: str = Field(description="The volume.")
    path: str = Field(description="The file, relative to the volume.")
    key: str = Field(description="The key.")
    optional: bool | None = Field(default=None, description="Whether the file or its key may be missing.")


ENV_SOURCES = ("configMapKeyRef", "fieldRef", "fileKeyRef", "resourceFieldRef", "secretKeyRef")
_ONE_SOURCE: list[JsonValue] = [
    {
        # A sum, not a list's exists_one(): cheap enough for CEL's cost budget on an unbounded env list.
        "rule": " + ".join(f"(has(self.{s}) ? 1 : 0)" for s in ENV_SOURCES) + " == 1",
        "message": f"valueFrom must set exactly one of {', '.join(ENV_SOURCES)}",
    }
]


class EnvVarSource(CrdModel):
    """A core/v1 EnvVarSource: where an environment variable's value comes from (exactly one source)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _ONE_SOURCE})

    configMapKeyRef: ConfigMapKeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    fieldRef: ObjectFieldSelector | None = Field(default=None, description="A field of the pod.")
    fileKeyRef: FileKeySelector | None = Field(default=None, description="A key of an env file in a volume.")
    resourceFieldRef: ResourceFieldSelector | None = Field(default=None, description="A container's resource.")
    secretKeyRef: SecretKeySelector | None = Field(default=None, description="A key of a Secret.")
