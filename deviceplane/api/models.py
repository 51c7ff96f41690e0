"""The agent's JSON model: `/api/v1/devices` and `NodeDevices.status` are this one model (DESIGN)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CamelModel(BaseModel):
    model_config = ConfigDict(populate_by_name=True, alias_generator=None, frozen=True)


class AllocatedTo(CamelModel):
    namespace: str
    pod: str
    container: str


class DeviceView(CamelModel):
    id: str
    health: str
    numaNodes: list[int] = Field(default_factory=list)
    allocatedTo: AllocatedTo | None = None


class PluginView(CamelModel):
    endpoint: str | None
    connected: bool
    preStartRequired: bool
    getPreferredAllocationAvailable: bool
    registeredAt: str | None


class ResourceView(CamelModel):
    name: str
    capacity: int
    allocatable: int
    healthy: int
    unhealthy: int
    allocated: int
    plugin: PluginView
    devices: list[DeviceView]
    devicesTruncated: bool = False


class AgentView(CamelModel):
    version: str
    node: str
    lastHeartbeatTime: str


class Condition(CamelModel):
    type: str
    status: str
    reason: str
    message: str
    lastTransitionTime: str


class DevicesStatus(CamelModel):
    resources: list[ResourceView]
    agent: AgentView
    conditions: list[Condition] = Field(default_factory=list)
