"""Proxy mode's two views of one resource, read the same way: the kubelet's (its device manager's GET /capacity in our
Go harness) and the agent's (`/api/v1/devices`). Used by the differential tests that push snapshots through the proxy.

What is compared: the counts (capacity, allocatable; the agent's healthy and unhealthy add up to them), and each
device the kubelet lists as allocatable (GetAllocatableDevices: an ID of its healthy set with its last copy's health
string and NUMA nodes), which the agent must list the same way; every other device the agent lists is Unhealthy.

A snapshot has been applied by a side when a marker snapshot sent just before it is gone from that side: each message
is a full replacement, so that needs no guess at what the side makes of the snapshot itself. The harness's answer is
not one snapshot of the device manager (its counts and its allocatable devices are two calls, GetCapacity and
GetAllocatableDevices, each under the manager's lock on its own; no method of the manager reads both), so the sides
are read once more after that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.support.procs import TestPlugin, wait_for

Listed = list[list[Any]]  # [[id, health, [numa, ...]], ...] as TestPlugin sends them
Shown = tuple[str, tuple[int, ...]]  # a device's health string and NUMA nodes


@dataclass(frozen=True)
class Side:
    """The kubelet's report of a resource: its counts, and its allocatable devices by ID."""

    capacity: int
    allocatable: int
    devices: Mapping[str, Shown]

    def ids(self) -> set[str]:
        return set(self.devices)


def kubelet_side(capacity: Mapping[str, Any], resource: str) -> Side | None:
    """The harness's GET /capacity for the resource; None before the kubelet has a message of it."""
    if resource not in capacity["capacity"]:
        return None
    devices = {d["id"]: (d["health"], tuple(d["numaNodes"])) for d in capacity["devices"].get(resource, [])}
    return Side(capacity["capacity"][resource], capacity["allocatable"][resource], devices)


@dataclass(frozen=True)
class AgentSide:
    capacity: int
    allocatable: int
    healthy: int  # the view's healthy and unhealthy counts, besides capacity and allocatable
    unhealthy: int
    devices: Mapping[str, Shown]  # every device the view lists

    @property
    def listed(self) -> set[str]:
        return set(self.devices)


def agent_side(resource: Mapping[str, Any] | None) -> AgentSide | None:
    """The agent's view of the resource; None unless its plugin is connected."""
    if resource is None or not resource["plugin"]["connected"]:
        return None
    return AgentSide(
        resource["capacity"],
        resource["allocatable"],
        resource["healthy"],
        resource["unhealthy"],
        {d["id"]: (d["health"], tuple(d["numaNodes"])) for d in resource["devices"]},
    )


def differences(kubelet: Side, agent: AgentSide) -> list[str]:
    """Where the agent's view is not the kubelet's (empty when it is)."""
    found = []
    if kubelet.allocatable != len(kubelet.devices):  # the harness's two calls saw two messages
        found.append(f"the kubelet counts {kubelet.allocatable} allocatable but lists {len(kubelet.devices)}")
    if (agent.capacity, agent.allocatable) != (kubelet.capacity, kubelet.allocatable):
        found.append(
            f"counts {agent.capacity}/{agent.allocatable}, the kubelet's {kubelet.capacity}/{kubelet.allocatable}"
        )
    if (agent.healthy, agent.unhealthy) != (agent.allocatable, agent.capacity - agent.allocatable):
        found.append(f"healthy/unhealthy {agent.healthy}/{agent.unhealthy} do not add up to the counts")
    for device_id, shown in sorted(kubelet.devices.items()):
        if agent.devices.get(device_id) != shown:
            found.append(f"{device_id!r}: allocatable as {shown} by the kubelet, listed {agent.devices.get(device_id)}")
    for device_id, (health, _numa) in sorted(agent.devices.items()):
        if device_id not in kubelet.devices and health != "Unhealthy":
            found.append(f"{device_id!r}: not allocatable by the kubelet, listed {health!r}")
    return found


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
