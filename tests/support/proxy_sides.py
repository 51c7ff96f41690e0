"""Proxy mode's two views of one resource, read the same way: the kubelet's (its device manager's GET /capacity in our
Go harness) and the agent's (`/api/v1/devices`). Used by the differential tests that push snapshots through the proxy.

A snapshot has been applied by a side when a marker snapshot sent just before it is gone from that side: each message
is a full replacement, so that needs no guess at what the side makes of the snapshot itself. The harness's answer is
not one snapshot of the device manager (its counts and its healthy devices are two calls), so the sides are read once
more after that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.procs import TestPlugin, wait_for

Listed = list[list[Any]]  # [[id, health, [numa, ...]], ...] as TestPlugin sends them


@dataclass(frozen=True)
class Side:
    """What one side reports of a resource: its counts, and its healthy devices with their NUMA nodes."""

    capacity: int
    allocatable: int
    healthy: frozenset[tuple[str, tuple[int, ...]]]

    def ids(self) -> set[str]:
        return {device_id for device_id, _ in self.healthy}


def kubelet_side(capacity: Mapping[str, Any], resource: str) -> Side | None:
    """The harness's GET /capacity for the resource; None before the kubelet has a message of it."""
    if resource not in capacity["capacity"]:
        return None
    healthy = frozenset((d["id"], tuple(d["numaNodes"])) for d in capacity["devices"].get(resource, []))
    return Side(capacity["capacity"][resource], capacity["allocatable"][resource], healthy)


@dataclass(frozen=True)
class AgentSide:
    side: Side
    healthy: int  # the view's healthy and unhealthy counts, besides capacity and allocatable
    unhealthy: int
    listed: frozenset[str]  # every device ID the view lists


def agent_side(resource: Mapping[str, Any] | None) -> AgentSide | None:
    """The agent's view of the resource; None unless its plugin is connected."""
    if resource is None or not resource["plugin"]["connected"]:
        return None
    devices = resource["devices"]
    healthy = frozenset((d["id"], tuple(d["numaNodes"])) for d in devices if d["health"] == "Healthy")
    return AgentSide(
        Side(resource["capacity"], resource["allocatable"], healthy),
        resource["healthy"],
        resource["unhealthy"],
        frozenset(d["id"] for d in devices),
    )


def marker(n: int) -> Listed:
    """A snapshot neither side can mistake for another: one healthy device of an ID no test snapshot uses."""
    return [[f"marker-{n}", "Healthy", []]]


def shows_only(kubelet: Side | None, agent: AgentSide | None, device_id: str) -> bool:
    """Both sides show the marker device and nothing else."""
    return (
        kubelet is not None
        and agent is not None
        and kubelet.ids() == {device_id}
        and (kubelet.capacity, kubelet.allocatable) == (1, 1)
        and agent.listed == {device_id}
    )


def moved_past(kubelet: Side | None, agent: AgentSide | None, device_id: str) -> bool:
    """Both sides have replaced the marker snapshot (with whatever the next one made of it)."""
    return (
        kubelet is not None
        and agent is not None
        and device_id not in kubelet.ids()  # the marker was its only healthy device
        and device_id not in agent.listed
    )


Read = Callable[[], tuple[Side | None, AgentSide | None]]


def push_and_read(plugin: TestPlugin, n: int, devices: Listed, read: Read) -> tuple[Side, AgentSide]:
    """Push marker `n` and wait until both sides show it, push `devices` and wait until both have applied them;
    then what each side makes of them. `n` must differ from the last call's."""
    device_id = marker(n)[0][0]
    plugin.devices(marker(n))
    wait_for(lambda: shows_only(*read(), device_id), timeout=20, what=f"both sides to show {device_id}")
    plugin.devices(devices)

    def applied() -> tuple[Side, AgentSide] | None:
        kubelet, agent = read()
        if kubelet is None or agent is None or not moved_past(kubelet, agent, device_id):
            return None
        return kubelet, agent

    wait_for(applied, timeout=20, what=f"both sides to apply {devices}")
    # Read once more: the harness's answer is two calls (GetCapacity, then GetAllocatableDevices), so the one that
    # first showed the marker gone may hold the marker's counts. Once the second call saw the new list, every later
    # answer is all of it (nothing else is sent meanwhile).
    sides = applied()
    assert sides is not None, "a side went back to the marker"
    return sides
