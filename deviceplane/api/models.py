"""The agent's JSON model: `/api/v1/devices` and `NodeDevices.status` are this one model (DESIGN)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FrozenModel(BaseModel):
    """Field names are the JSON names (camelCase, as Kubernetes objects spell them)."""

    model_config = ConfigDict(frozen=True)


class AllocatedTo(FrozenModel):
    namespace: str
    pod: str
    container: str


class DeviceView(FrozenModel):
    id: str
    health: str
    numaNodes: list[int] = Field(default_factory=list)
    allocatedTo: AllocatedTo | None = None


class PluginView(FrozenModel):
    endpoint: str | None
    connected: bool
    preStartRequired: bool
    getPreferredAllocationAvailable: bool
    registeredAt: str | None


class ResourceView(FrozenModel):
    name: str
    capacity: int
    allocatable: int
    healthy: int
    unhealthy: int
    allocated: int
    plugin: PluginView
    devices: list[DeviceView]
    devicesTruncated: bool = False


class AgentView(FrozenModel):
    version: str
    node: str
    lastHeartbeatTime: str


class Condition(FrozenModel):
    type: str
    status: str
    reason: str
    message: str
    lastTransitionTime: str


class DevicesStatus(FrozenModel):
    resources: list[ResourceView]
    agent: AgentView
    conditions: list[Condition] = Field(default_factory=list)
