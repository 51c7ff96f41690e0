"""The conditions of the devices view (`NodeDevices.status.conditions`, `/api/v1/devices`): pure.

Two, judged from the resources (their counts are exact even when the device lists are truncated):
- `PluginsConnected`: every resource's plugin has its ListAndWatch stream up (a resource whose plugin is down has
  no allocatable devices until it is back);
- `DevicesHealthy`: no resource has an unhealthy device.

A condition's `lastTransitionTime` moves only when its status does (`ConditionTimes` remembers the last ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deviceplane.api.models import Condition

PLUGINS_CONNECTED = "PluginsConnected"
DEVICES_HEALTHY = "DevicesHealthy"

Judgement = tuple[str, str, str]  # status ("True" / "False"), reason, message


@dataclass(frozen=True, slots=True)
class ResourceCounts:
    """What the conditions are judged from, per resource (core/view.py's `resource_counts`): a view of every
    resource on each request would cost a model per resource, also for a count poll of one."""

    name: str
    connected: bool
    capacity: int
    healthy: int
    unhealthy: int


def plugins_connected(resources: Sequence[ResourceCounts]) -> Judgement:
    """`PluginsConnected`, naming the resources whose plugin's stream is down."""
    down = [r.name for r in resources if not r.connected]
    if down:
        return "False", "PluginDisconnected", f"not connected: {', '.join(down)}"
    return "True", "AllConnected", f"{len(resources)} of {len(resources)} plugins connected"


def devices_healthy(resources: Sequence[ResourceCounts]) -> Judgement:
    """`DevicesHealthy`, naming each resource with unhealthy devices."""
    unhealthy = [f"{r.name}: {r.unhealthy} of {r.capacity} unhealthy" for r in resources if r.unhealthy]
    if unhealthy:
        return "False", "UnhealthyDevices", "; ".join(unhealthy)
    return "True", "AllHealthy", f"{sum(r.healthy for r in resources)} devices healthy"


JUDGES: Mapping[str, Callable[[Sequence[ResourceCounts]], Judgement]] = {
    PLUGINS_CONNECTED: plugins_connected,
    DEVICES_HEALTHY: devices_healthy,
}


def conditions(resources: Sequence[ResourceCounts], now: str, previous: Mapping[str, Condition]) -> list[Condition]:
    """The conditions of `resources` at `now` (RFC 3339), with the times of `previous` kept (`keep_times`)."""
    judged = []
    for kind, judge in JUDGES.items():
        status, reason, message = judge(resources)
        judged.append(Condition(type=kind, status=status, reason=reason, message=message, lastTransitionTime=now))
    return keep_times(judged, previous)


def keep_times(found: Iterable[Condition], previous: Mapping[str, Condition]) -> list[Condition]:
    """`found`, where a condition's status is the same as in `previous` (by type) with the lastTransitionTime it had
    there: a time moves only when the status does."""
    result = []
    for condition in found:
        before = previous.get(condition.type)
        if before is not None and before.status == condition.status:
            condition = condition.model_copy(update={"lastTransitionTime": before.lastTransitionTime})
        result.append(condition)
    return result


class ConditionTimes:
    """The last conditions, by type: what keeps their transition times from one computation to the next."""

    def __init__(self) -> None:
        self._last: dict[str, Condition] = {}

    def update(self, resources: Sequence[ResourceCounts], now: str) -> list[Condition]:
        """The conditions of `resources`, judged at `now`."""
        return self._remember(conditions(resources, now, self._last))

    def carry(self, found: Iterable[Condition]) -> list[Condition]:
        """Conditions judged elsewhere, with the times kept here where their status has not changed."""
        return self._remember(keep_times(found, self._last))

    def restore(self, found: Iterable[Condition]) -> None:
        """Conditions written earlier (by an earlier agent): their times still hold where their status does. Ignored
        once conditions were computed here (those are newer)."""
        if not self._last:
            self._last = {c.type: c for c in found if c.type in JUDGES}

    def _remember(self, found: list[Condition]) -> list[Condition]:
        self._last = {c.type: c for c in found}
        return found
