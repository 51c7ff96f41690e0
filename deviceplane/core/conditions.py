"""The conditions of the devices view (`NodeDevices.status.conditions`, `/api/v1/devices`): pure.

Two, judged from the resources (their counts are exact even when the device lists are truncated):
- `PluginsConnected`: every resource's plugin has its ListAndWatch stream up (a resource whose plugin is down has
  no allocatable devices until it is back);
- `DevicesHealthy`: no resource has an unhealthy device.
In proxy mode a third, judged from the kubelet's PodResources as the agent last polled it:
- `OwnersCurrent`: the owners shown (`allocatedTo`, the allocated counts) are the kubelet's latest: listed, and no
  outage since. Absent in agent mode, where the agent allocates and its owners cannot be out of date.
Each message is a function of what is judged, so it changes only with it: the NodeDevices publisher compares them
to know whether to write (an outage is named by its start, not by a count of seconds that would change each second).

A condition's `lastTransitionTime` moves only when its status does (`ConditionTimes` remembers the last ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deviceplane.api.models import Condition
from deviceplane.core.times import rfc3339

PLUGINS_CONNECTED = "PluginsConnected"
DEVICES_HEALTHY = "DevicesHealthy"
OWNERS_CURRENT = "OwnersCurrent"

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


@dataclass(frozen=True, slots=True)
class PodResourcesLink:
    """Proxy mode: the kubelet's PodResources as the agent's poller last saw it (agent/proxy/ownership.py), what
    `OwnersCurrent` is judged from. Times are Unix times."""

    last_listed: float | None  # the last successful listing; None before the first
    lost_since: float | None  # when it stopped answering; None while the last poll answered
    error: str | None  # why it stopped (the first failed call's gRPC code and details); None while it answers


def owners_current(link: PodResourcesLink) -> Judgement:
    """`OwnersCurrent`: True while the last listing succeeded and no poll failed since; otherwise since when and why
    not, and how old the owners shown are."""
    why = f" ({link.error})" if link.error else ""
    if link.last_listed is None:
        return "False", "PodResourcesNotListed", f"kubelet PodResources not listed yet{why}: no device owners known"
    if link.lost_since is None:
        return "True", "PodResourcesListed", "kubelet PodResources answering: device owners as it last listed them"
    return (
        "False",
        "PodResourcesUnreachable",
        f"kubelet PodResources unreachable since {rfc3339(link.lost_since)}{why}: device owners are as of "
        f"{rfc3339(link.last_listed)}",
    )


JUDGES: Mapping[str, Callable[[Sequence[ResourceCounts]], Judgement]] = {
    PLUGINS_CONNECTED: plugins_connected,
    DEVICES_HEALTHY: devices_healthy,
}
KNOWN = frozenset({*JUDGES, OWNERS_CURRENT})  # what an earlier agent's object may hold that is still judged


def conditions(
    resources: Sequence[ResourceCounts],
    now: str,
    previous: Mapping[str, Condition],
    pod_resources: PodResourcesLink | None = None,
) -> list[Condition]:
    """The conditions of `resources` (and, in proxy mode, of `pod_resources`) at `now` (RFC 3339), with the times of
    `previous` kept (`keep_times`)."""
    judgements = [(kind, judge(resources)) for kind, judge in JUDGES.items()]
    if pod_resources is not None:
        judgements.append((OWNERS_CURRENT, owners_current(pod_resources)))
    judged = [
        Condition(type=kind, status=status, reason=reason, message=message, lastTransitionTime=now)
        for kind, (status, reason, message) in judgements
    ]
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

    def update(
        self, resources: Sequence[ResourceCounts], now: str, pod_resources: PodResourcesLink | None = None
    ) -> list[Condition]:
        """The conditions of `resources` (and `pod_resources`, in proxy mode), judged at `now`."""
        return self._remember(conditions(resources, now, self._last, pod_resources))

    def carry(self, found: Iterable[Condition]) -> list[Condition]:
        """Conditions judged elsewhere, with the times kept here where their status has not changed."""
        return self._remember(keep_times(found, self._last))

    def restore(self, found: Iterable[Condition]) -> None:
        """Conditions written earlier (by an earlier agent): their times still hold where their status does. Ignored
        once conditions were computed here (those are newer)."""
        if not self._last:
            self._last = {c.type: c for c in found if c.type in KNOWN}

    def _remember(self, found: list[Condition]) -> list[Condition]:
        self._last = {c.type: c for c in found}
        return found
