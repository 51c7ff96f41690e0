"""Build the devices view (`/api/v1/devices`, NodeDevices.status) from the registry: pure."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from deviceplane.api.models import AgentView, AllocatedTo, DevicesStatus, DeviceView, PluginView, ResourceView
from deviceplane.core.conditions import ConditionTimes, PodResourcesLink, ResourceCounts
from deviceplane.core.constants import HEALTHY, UNHEALTHY
from deviceplane.core.device_sets import kubelet_counts
from deviceplane.core.registry import Device, DeviceRegistry, ResourceStatus
from deviceplane.core.times import rfc3339


class Holders(Protocol):
    """Who holds the devices. `holder` is asked only for the devices a view lists: a count poll (limit=0) must not
    pay for every allocation on the node (building them all cost 10 ms per GET at 5,000 held)."""

    def allocated_count(self, resource: str) -> int:
        """How many of the resource's devices are held."""
        ...

    def holder(self, resource: str, device_id: str) -> AllocatedTo | None: ...

    def held(self, resource: str) -> Collection[str]:
        """The resource's devices that are held (asked only when a view cuts the resource's list)."""
        ...


class NoHolders:
    def allocated_count(self, resource: str) -> int:
        return 0

    def held(self, resource: str) -> Collection[str]:
        return ()

    def holder(self, resource: str, device_id: str) -> AllocatedTo | None:
        return None


# Proxy mode: whether a resource's proxy endpoint is registered with the kubelet now (None: not proxied).
KubeletRegistered = Callable[[str], bool | None]


def _plugin_view(state: ResourceStatus, kubelet_registered: KubeletRegistered | None = None) -> PluginView:
    endpoint = state.primary
    options = endpoint.options if endpoint is not None else None
    return PluginView(
        endpoint=endpoint.socket_path if endpoint is not None else None,
        connected=state.connected,
        preStartRequired=bool(options and options.pre_start_required),
        getPreferredAllocationAvailable=bool(options and options.get_preferred_allocation_available),
        registeredAt=rfc3339(endpoint.registered_wall)
        if endpoint is not None and endpoint.socket_path and endpoint.registered_wall is not None
        else None,
        kubeletRegistered=kubelet_registered(state.name) if kubelet_registered is not None else None,
    )


def resource_view(
    state: ResourceStatus,
    counts: ResourceCounts,
    holders: Holders,
    device_limit: int | None = None,
    kubelet_registered: KubeletRegistered | None = None,
) -> ResourceView:
    if device_limit == 0:  # a count poll: nothing listed, nothing sorted (it follows every registration)
        shown: list[str] = []
        truncated = bool(state.all_devices)
    else:
        ids = state.sorted_ids()
        if device_limit is None or len(ids) <= device_limit:
            shown = ids
        else:
            shown = listed_first(state, holders.held(state.name), device_limit)
        truncated = len(shown) < len(ids)
    devices = []
    for device_id in shown:
        device = state.all_devices[device_id]
        devices.append(
            DeviceView(
                id=device_id,
                health=shown_health(state, device_id, device),
                numaNodes=list(device.numa_nodes),
                allocatedTo=holders.holder(state.name, device_id),
            )
        )
    return ResourceView(
        name=state.name,
        capacity=counts.capacity,
        allocatable=counts.healthy,  # as the registry's capacity(): the healthy devices
        healthy=counts.healthy,
        unhealthy=counts.unhealthy,
        allocated=holders.allocated_count(state.name),
        plugin=_plugin_view(state, kubelet_registered),
        devices=devices,
        devicesTruncated=truncated,
    )


def shown_health(state: ResourceStatus, device_id: str, device: Device) -> str:
    """A device's health as GetAllocatableDevices lists it (spec §4.13): an ID in the healthy set with its last
    copy's health string, as sent; any other ID is Unhealthy (also every device of a disconnected plugin). Only
    proxy mode can show a string but Healthy for an ID in the healthy set (one it was sent with Healthy and then
    otherwise: the kubelet may allocate it, and lists it so); agent mode keeps one copy of each ID, so there it is
    Healthy exactly when the set has it."""
    return device.health if device_id in state.healthy else UNHEALTHY


def listed_first(state: ResourceStatus, held: Collection[str], limit: int) -> list[str]:
    """The `limit` devices a cut list shows, in ID order: the ones listed as not Healthy first, then the held ones,
    then the rest. The first `limit` IDs alone could leave out exactly the devices someone reads the list for. Never
    a sort or a full pass of every ID when few are unhealthy or held: for 10 x 10,000 devices, 1 in 7 unhealthy
    (benchmarks/nodedevices.py's), 0.03 ms a resource; the whole bounded build 3.0 -> 3.9 ms."""
    ids, devices = state.sorted_ids(), state.all_devices
    picked: set[str] = set()
    if state.unhealthy:  # some device is listed as not Healthy (with an ID sent twice, not only those)
        # The plugin's unhealthy set, when with the healthy one it is every device once: no pass over every ID to
        # find them. Otherwise (proxy mode, an ID sent both Healthy and not) a pass, for the IDs the healthy set has
        # but that are listed by a last copy that is not Healthy.
        partitioned = len(state.healthy) + len(state.unhealthy) == len(ids)
        _add_first(picked, ids, state.unhealthy if partitioned else _listed_not_healthy(state), limit)
    if held and len(picked) < limit:
        _add_first(picked, ids, [d for d in held if d in devices and d not in picked], limit)
    for device_id in ids:
        if len(picked) >= limit:
            break
        picked.add(device_id)
    return sorted(picked)  # sorted_ids' order


def _listed_not_healthy(state: ResourceStatus) -> set[str]:
    healthy = state.healthy
    return {i for i, device in state.all_devices.items() if i not in healthy or device.health != HEALTHY}


def _add_first(picked: set[str], ids: Sequence[str], members: Collection[str], limit: int) -> None:
    """Add to `picked` the first of `members` (devices of `ids`) in `ids`' order, until it holds `limit`."""
    room = limit - len(picked)
    if len(members) <= 4 * limit:  # few: sort them
        picked.update(sorted(members)[:room])
        return
    wanted = members if isinstance(members, (set, frozenset)) else set(members)
    for device_id in ids:  # many: the first ones come early in the scan
        if len(picked) >= limit:
            break
        if device_id in wanted:
            picked.add(device_id)


def resource_counts(state: ResourceStatus) -> ResourceCounts:
    """The resource's counts, as DeviceRegistry.capacity() gives them (the kubelet's rule: core/device_sets.py), from
    its own state, without a pass over every resource."""
    capacity, healthy = kubelet_counts(state.healthy, state.unhealthy)
    return ResourceCounts(state.name, state.connected, capacity, healthy, len(state.unhealthy))


def devices_status(
    registry: DeviceRegistry,
    agent: AgentView,
    holders: Holders | None = None,
    device_limit: int | None = None,
    resource_filter: Callable[[str], bool] | None = None,
    conditions: ConditionTimes | None = None,
    kubelet_registered: KubeletRegistered | None = None,
    pod_resources: PodResourcesLink | None = None,
) -> DevicesStatus:
    """The view; with `conditions`, the node's conditions too (judged over every resource, those `resource_filter`
    leaves out included, and in proxy mode over `pod_resources`, at `agent.lastHeartbeatTime`; their transition times
    kept in `conditions`)."""
    if holders is None:
        holders = NoHolders()
    resources = []
    judged = []  # every resource's counts, the ones left out of the view included
    for state in registry.statuses():
        shown = resource_filter is None or resource_filter(state.name)
        if not shown and conditions is None:
            continue
        counts = resource_counts(state)
        if conditions is not None:
            judged.append(counts)
        if shown:
            resources.append(resource_view(state, counts, holders, device_limit, kubelet_registered))
    if conditions is None:
        return DevicesStatus(resources=resources, agent=agent)
    found = conditions.update(judged, agent.lastHeartbeatTime, pod_resources)
    return DevicesStatus(resources=resources, agent=agent, conditions=found)
