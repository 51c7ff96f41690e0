"""The agent's JSON model: `/api/v1/devices` and `NodeDevices.status` are this one model (DESIGN).

The field descriptions are what `kubectl explain nodedevices.status` prints (crds/ is generated from this model).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field


class FrozenModel(BaseModel):
    """Field names are the JSON names (camelCase, as Kubernetes objects spell them)."""

    model_config = ConfigDict(frozen=True)


class AllocatedTo(FrozenModel):
    """The container a device is allocated to."""

    namespace: str = Field(description="Namespace of the pod.")
    pod: str = Field(description="Name of the pod.")
    container: str = Field(description="Name of the container (init or app) the device was allocated to.")


class DeviceView(FrozenModel):
    """One device as its plugin reported it, with its current owner."""

    id: str = Field(description="Device ID as the plugin reported it (ListAndWatch).")
    health: str = Field(
        description="Effective health, Healthy or Unhealthy: as last reported by the plugin, and Unhealthy while the "
        "plugin is disconnected. Proxy mode lists a device as the kubelet does: one the plugin sent more than once, "
        "Healthy and otherwise, is allocatable with its last copy's health string, as sent."
    )
    numaNodes: list[int] = Field(
        default_factory=list, description="NUMA nodes of the device's topology; empty when the plugin gave none."
    )
    allocatedTo: AllocatedTo | None = Field(
        default=None, description="The container holding the device; null when the device is free."
    )


class PluginView(FrozenModel):
    """The device plugin serving a resource."""

    # Optional in the CRD, not required-and-nullable: a JSON merge patch drops null keys, and a restored resource has
    # no endpoint until its plugin registers again (a required key missing made the API server refuse the status).
    endpoint: str | None = Field(
        default=None,
        description="Absolute path of the plugin's socket; null (absent in NodeDevices) while a resource restored "
        "from the checkpoint waits for its plugin.",
    )
    connected: bool = Field(description="Whether the plugin's ListAndWatch stream is up.")
    preStartRequired: bool = Field(description="The plugin asked for PreStartContainer calls.")
    getPreferredAllocationAvailable: bool = Field(description="The plugin implements GetPreferredAllocation.")
    registeredAt: str | None = Field(default=None, description="When the plugin last registered (RFC 3339).")
    # Optional, absent in agent mode (nothing is registered with a kubelet then), as `endpoint` above.
    kubeletRegistered: bool | None = Field(
        default=None,
        description="Proxy mode: whether the agent's endpoint for the resource is registered with the kubelet now "
        "(false while the kubelet restarts or after it dropped the endpoint, until registered again; the kubelet "
        "sees no devices of the resource without it); null in agent mode (absent in NodeDevices).",
    )


class ResourceView(FrozenModel):
    """One extended resource on the node: counts are exact even when the device list is truncated."""

    name: str = Field(description="Extended resource name, e.g. example.com/gpu.")
    capacity: int = Field(description="Devices the plugin reported (healthy and unhealthy).")
    allocatable: int = Field(description="Healthy devices: what the scheduler may hand out.")
    healthy: int = Field(description="Devices whose effective health is Healthy (see devices[].health).")
    unhealthy: int = Field(description="Devices whose effective health is Unhealthy: all while the plugin is down.")
    allocated: int = Field(description="Devices currently allocated to containers.")
    plugin: PluginView = Field(description="The plugin serving this resource.")
    devices: list[DeviceView] = Field(
        description="The devices, sorted by ID as plain strings (dev10 before dev2); bounded (see devicesTruncated)."
    )
    devicesTruncated: bool = Field(
        default=False, description="True when the device list was cut to its bound; the counts above stay exact."
    )


class AgentView(FrozenModel):
    """The node agent that wrote this status."""

    version: str = Field(description="deviceplane version of the agent.")
    node: str = Field(description="The node the agent runs on.")
    lastHeartbeatTime: str = Field(description="When the agent last confirmed this status (RFC 3339).")


class Condition(FrozenModel):
    """A Kubernetes-style condition."""

    type: str = Field(description="Condition type.")
    status: str = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(description="Human-readable detail.")
    lastTransitionTime: str = Field(description="When status last changed (RFC 3339).")


class DevicesStatus(FrozenModel):
    """The devices of one node, as its deviceplane agent sees them (also served at /api/v1/devices)."""

    resources: list[ResourceView] = Field(description="Extended resources served on the node, by name.")
    agent: AgentView = Field(description="The agent publishing this status.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="PluginsConnected (False: a resource's plugin is disconnected, named in the message) and "
        "DevicesHealthy (False: a resource has unhealthy devices, each named with its count), judged over every "
        "resource; in proxy mode also OwnersCurrent (False: the kubelet's PodResources is not listed yet, or has not "
        "answered since the time named, and the owners shown are as of its last listing). A lastTransitionTime "
        "moves only when its status does.",
    )

    # Totals for `kubectl get nodedevices` (printer columns cannot sum a list); derived, so never out of step.
    @computed_field(description="Number of resources served on the node.")  # type: ignore[prop-decorator]
    @property
    def resourceCount(self) -> int:
        return len(self.resources)

    @computed_field(description="Devices over all resources (their capacity).")  # type: ignore[prop-decorator]
    @property
    def deviceCount(self) -> int:
        return sum(r.capacity for r in self.resources)

    @computed_field(description="Healthy devices over all resources.")  # type: ignore[prop-decorator]
    @property
    def healthyCount(self) -> int:
        return sum(r.healthy for r in self.resources)

    @computed_field(description="Allocated devices over all resources.")  # type: ignore[prop-decorator]
    @property
    def allocatedCount(self) -> int:
        return sum(r.allocated for r in self.resources)
