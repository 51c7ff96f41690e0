"""Names, labels and annotations the operator puts on what it creates (one place, used by rendering and watching)."""

from __future__ import annotations

from dataclasses import dataclass

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "deviceplane-operator"
# Our DaemonSets and their pods: kopf's watches and the listing gate's pod list must select the same ones.
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
CONFIG_LABEL = "deviceplane.io/config"  # the owning DevicePluginConfig's name, on the DaemonSet and its pods
NAME_LABEL = "app.kubernetes.io/name"
PLUGIN_APP = "deviceplane-plugin"
RENDER_HASH_ANNOTATION = "deviceplane.io/render-hash"  # hash of what we rendered: update only when it changes
CONFIG_HASH_ANNOTATION = "deviceplane.io/config-hash"  # on the pod template: the ConfigMap's content hash
DAEMONSET_SUFFIX = "-plugin"


@dataclass(frozen=True, order=True)
class ConfigKey:
    """A DevicePluginConfig's namespace and name."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def daemonset(self) -> str:
        return self.name + DAEMONSET_SUFFIX
