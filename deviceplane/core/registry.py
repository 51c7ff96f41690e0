"""Devices, health and plugin endpoints per resource: the kubelet device manager's bookkeeping, pure.

Mirrors spec §4.3.2-4.5 (per-socket endpoints, exact-"Healthy" rule, disconnect marks a resource unhealthy, grace
period before deletion) with deliberate improvements over the kubelet:

- Only the *primary* endpoint of a resource (the newest connected one) feeds its device view; every endpoint's last
  snapshot is kept, so when the primary disconnects the promoted survivor's own devices take over at once. Upstream
  lets any stream overwrite the view (a stale plugin can clobber a newer one's devices) and keeps the dead primary's
  health until the survivor happens to send an update.
- Health transitions are counted per device, for metrics.
- A snapshot identical to the one shown changes nothing (upstream rebuilds its sets and rewrites its checkpoint for
  every message): the objects keep their identity, so what others derived from them stays valid.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from deviceplane.core.constants import HEALTHY, NODE_WITHOUT_TOPOLOGY
from deviceplane.core.device_sets import device_sets, kubelet_counts


class Device(NamedTuple):
    """One device as the plugin last reported it. A NamedTuple: snapshots carry thousands, built per message."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def is_healthy(self) -> bool:
        # Upstream compares the exact string: "healthy", "" or anything else counts as unhealthy.
        return self.health == HEALTHY

    @property
    def numa_keys(self) -> tuple[int, ...]:
        """NUMA nodes under which the kubelet books this device (-1 when it has no topology)."""
        return self.numa_nodes or (NODE_WITHOUT_TOPOLOGY,)


@dataclass(frozen=True, slots=True)
class PluginOptions:
    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False


@dataclass(slots=True)
class Endpoint:
    """A plugin connection for one resource, identified by its socket path.

    `socket_path` is None for the placeholder a checkpoint restores: the resource is known, its plugin is not yet.
    Times are monotonic (a wall-clock step never deletes or keeps a resource early); `registered_wall` is the
    wall-clock time of registration, only shown.
    """

    socket_path: str | None
    options: PluginOptions | None
    registered_at: float
    stop_time: float | None = None
    devices: tuple[Device, ...] = ()
    registered_wall: float | None = None
    # `devices` is a list the plugin sent (its first ListAndWatch message came), not the empty default: an empty list
    # sent is told apart from none yet.
    listed: bool = False

    @property
    def is_stopped(self) -> bool:
        return self.stop_time is not None

    def grace_expired(self, now: float, grace_period: float) -> bool:
        return self.stop_time is not None and now - self.stop_time > grace_period


class AlreadyConnectedError(Exception):
    """The same (resource, socket) pair connected twice (spec §6.1 item 25)."""

    def __init__(self, resource: str, socket_path: str) -> None:
        super().__init__(f"device plugin already connected for resource {resource} at socket {socket_path}")


@dataclass(slots=True)
class ResourceState:
    name: str
    # Connected endpoints by socket path; empty once the last plugin has gone.
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    # The endpoint whose devices are shown; after the last disconnect it stays here, stopped, for the grace period.
    primary: Endpoint | None = None
    all_devices: dict[str, Device] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    # `healthy` sorted, with the set it was made from: every change replaces the set, so identity says it is current.
    _sorted_healthy: tuple[set[str], list[str]] | None = field(default=None, repr=False, compare=False)
    # Every ID of `all_devices` sorted, with the mapping whose IDs it holds (the current one, or one with the same IDs).
    _sorted_ids: tuple[dict[str, Device], list[str]] | None = field(default=None, repr=False, compare=False)
    # The snapshot the sets were made from, None when they are not a snapshot's (before the first, after
    # mark_unhealthy).
    _shown: tuple[Device, ...] | None = field(default=None, repr=False, compare=False)

    def sorted_healthy(self) -> list[str]:
        """The healthy IDs in order, sorted once per change (every checkpoint asks; 0.7 ms for 5,016 IDs, measured
        in isolation). Shared: callers must not modify it."""
        kept = self._sorted_healthy
        if kept is None or kept[0] is not self.healthy:
            kept = self._sorted_healthy = (self.healthy, _resorted(kept, self.healthy))
        return kept[1]

    def allocatable(self) -> list[Device]:
        """Spec §4.13 GetAllocatableDevices for this resource: the healthy devices, by ID."""
        devices = self.all_devices
        return [devices[i] for i in self.sorted_healthy() if i in devices]

    def sorted_ids(self) -> list[str]:
        """Every device ID in order, sorted once per change of the IDs: the views list the first few (NodeDevices:
        128 of each resource per publish), which otherwise took a partial sort of every ID per resource and view
        (0.2-0.3 ms at 10,000 devices). A snapshot with the same IDs (a health change) keeps the list, found by
        comparing the two mappings' key sets (C-speed) rather than sorting again (1.2-1.4 ms for 10,000 UUIDs).
        Shared: callers must not modify it."""
        kept, devices = self._sorted_ids, self.all_devices
        if kept is None or (kept[0] is not devices and kept[0].keys() != devices.keys()):
            kept = self._sorted_ids = (devices, sorted(devices))
        elif kept[0] is not devices:
            kept = self._sorted_ids = (devices, kept[1])
        return kept[1]

    def show(self, devices: tuple[Device, ...]) -> bool:
        """Show a snapshot. An identical one (plugins resend their whole list, often unchanged) changes nothing and
        returns False: the mapping and the sets keep their identity, so what callers derived from them stays valid
        (at 10,000 devices the device order and free-device index took 5.7 ms to rebuild, the sorted healthy IDs
        1.8 ms: benchmarks/snapshot_churn.py)."""
        if devices == self._shown:
            return False
        # Upstream's sets, also for an ID sent twice (core/device_sets.py).
        self.all_devices, self.healthy, self.unhealthy = device_sets(devices)
        self._shown = devices
        return True

    def mark_unhealthy(self) -> None:
        """Spec §4.4 markResourceUnhealthy: healthy moves to unhealthy, the reported devices stay as they were."""
        self.unhealthy |= self.healthy
        self.healthy = set()
        self._shown = None  # no longer what any snapshot says

    @property
    def connected(self) -> bool:
        return bool(self.endpoints)


# A health change of up to this many devices updates the previous sorted list (a copy and a bisection each) rather
# than sorting every ID again: a device or a few flipping is the common change, and at 10,000 devices the sort took
# ~1.8 ms of the loop against 0.6-0.8 ms, most of it finding what changed (benchmarks/snapshot_churn.py).
_RESORT_AFTER = 64


def _resorted(kept: tuple[set[str], list[str]] | None, healthy: set[str]) -> list[str]:
    if kept is not None:
        changed = kept[0] ^ healthy
        if len(changed) <= _RESORT_AFTER:
            ids = kept[1].copy()
            for device_id in changed:
                if device_id in healthy:
                    bisect.insort(ids, device_id)
                else:
                    del ids[bisect.bisect_left(ids, device_id)]
            return ids
    return sorted(healthy)


class ResourceStatus(Protocol):
    """A resource as readers see it (views, metrics): `ResourceState` without the means to change it."""

    @property
    def name(self) -> str: ...

    @property
    def primary(self) -> Endpoint | None: ...

    @property
    def all_devices(self) -> Mapping[str, Device]: ...

    @property
    def healthy(self) -> Set[str]: ...

    @property
    def unhealthy(self) -> Set[str]: ...

    @property
    def connected(self) -> bool: ...

    def sorted_ids(self) -> list[str]: ...

    def allocatable(self) -> list[Device]: ...


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """What one ListAndWatch message changed."""

    applied: bool  # False when it came from a non-primary endpoint (kept, not shown)
    changed: bool = False  # it replaced what is shown (False when not applied, or identical to what was shown)
    transitions: tuple[str, ...] = ()  # IDs whose health flipped (counted for metrics)


@dataclass(frozen=True, slots=True)
class Capacity:
    capacity: dict[str, int]
    allocatable: dict[str, int]


class DeviceRegistry:
    """All resources known to the device manager. Not thread-safe: the agent calls it from one event loop."""

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self._resources: dict[str, ResourceState] = {}

    # -- plugin lifecycle -------------------------------------------------------------------------------------------

    def plugin_connected(
        self, resource: str, socket_path: str, options: PluginOptions, now: float, wall: float | None = None
    ) -> Endpoint:
        state = self._resources.get(resource)
        if state is not None and socket_path in state.endpoints:
            raise AlreadyConnectedError(resource, socket_path)
        if state is None:
            state = self._resources[resource] = ResourceState(resource)
        endpoint = Endpoint(socket_path, options, registered_at=now, registered_wall=wall)
        state.endpoints[socket_path] = endpoint
        # The newest plugin is primary; until its first snapshot the resource shows what it had (upstream keeps the
        # old sets until the new stream's first message replaces them).
        state.primary = endpoint
        return endpoint

    def plugin_reconnected(
        self, resource: str, socket_path: str, options: PluginOptions, now: float, wall: float | None = None
    ) -> Endpoint:
        """A plugin registered again on a socket it already holds: it restarted in place (most plugins use a fixed
        socket name). The new connection takes the old one's place without a disconnect in between, so allocatable
        never drops to 0 for a restart. Upstream either ignores the second registration or locks the plugin out until
        the old stream breaks (spec §4.3.2 oddities)."""
        state = self._resources.get(resource)
        old = state.endpoints.get(socket_path) if state is not None else None
        if state is None or old is None:
            return self.plugin_connected(resource, socket_path, options, now, wall)
        old.stop_time = now
        endpoint = Endpoint(
            socket_path, options, registered_at=now, devices=old.devices, registered_wall=wall, listed=old.listed
        )
        state.endpoints[socket_path] = endpoint
        if state.primary is old:
            state.primary = endpoint
        return endpoint

    def plugin_disconnected(self, resource: str, socket_path: str, now: float) -> bool:
        """Spec §4.3.2 PluginDisconnected. Returns False (and changes nothing) for an unknown resource or socket."""
        state = self._resources.get(resource)
        if state is None:
            return False
        endpoint = state.endpoints.pop(socket_path, None)
        if endpoint is None:
            return False
        endpoint.stop_time = now
        if state.primary is not endpoint:
            return True
        if state.endpoints:
            survivor = max(state.endpoints.values(), key=lambda e: e.registered_at)
            state.primary = survivor
            state.show(survivor.devices)
        else:
            state.mark_unhealthy()
        return True

    def apply_snapshot(self, resource: str, socket_path: str, devices: Sequence[Device]) -> SnapshotResult:
        """One ListAndWatch message: a full replacement of the endpoint's devices (spec §4.4)."""
        state = self._resources.get(resource)
        endpoint = state.endpoints.get(socket_path) if state is not None else None
        if state is None or endpoint is None:
            return SnapshotResult(applied=False)
        endpoint.devices = tuple(devices)
        endpoint.listed = True
        if state.primary is not endpoint:
            return SnapshotResult(applied=False)
        previous = state.all_devices
        if not state.show(endpoint.devices):
            return SnapshotResult(applied=True)
        # Over the shown mapping, not the message: an ID sent twice is one device, flipped at most once.
        transitions = tuple(
            device_id
            for device_id, (_, health, _) in state.all_devices.items()
            if (before := previous.get(device_id)) is not None and before.health != health
        )
        return SnapshotResult(applied=True, changed=True, transitions=transitions)

    def restore(self, resources: Iterable[str], now: float) -> None:
        """Checkpointed resources come back with a stopped placeholder endpoint and no devices: 0/0 until their
        plugin re-registers, deleted if it does not within the grace period (spec §4.9 read path)."""
        for resource in resources:
            state = self._resources.setdefault(resource, ResourceState(resource))
            if state.primary is None:
                state.primary = Endpoint(socket_path=None, options=None, registered_at=now, stop_time=now)

    # -- views ------------------------------------------------------------------------------------------------------

    def expire(self, now: float) -> tuple[str, ...]:
        """Spec §4.5 GetCapacity's removal half: delete the resources whose plugin is gone for longer than the grace
        period (from both health sets, as since kubernetes#133724); returns their names. `now` is monotonic."""
        deleted = tuple(
            name
            for name, state in self._resources.items()
            if state.primary is None or (not state.endpoints and state.primary.grace_expired(now, self.grace_period))
        )
        for name in deleted:
            del self._resources[name]
        return deleted

    def capacity(self) -> Capacity:
        """Spec §4.5 GetCapacity's counts, read only: resources past their grace period stay until `expire`."""
        capacity: dict[str, int] = {}
        allocatable: dict[str, int] = {}
        for name, state in self._resources.items():
            capacity[name], allocatable[name] = kubelet_counts(state.healthy, state.unhealthy)
        return Capacity(capacity, allocatable)

    def __contains__(self, resource: object) -> bool:
        return resource in self._resources

    def resource(self, resource: str) -> ResourceStatus | None:
        return self._resources.get(resource)

    def statuses(self) -> list[ResourceStatus]:
        """Every resource, by name."""
        return [self._resources[name] for name in sorted(self._resources)]

    def connected_sockets(self, resource: str) -> list[str]:
        """Socket paths of the plugins connected for the resource, in connection order."""
        state = self._resources.get(resource)
        return list(state.endpoints) if state is not None else []

    def primary_endpoint(self, resource: str) -> Endpoint | None:
        state = self._resources.get(resource)
        return state.primary if state is not None else None

    def devices(self, resource: str) -> Mapping[str, Device]:
        """The shown devices by ID. The same mapping until the next snapshot replaces it (callers cache by identity)."""
        state = self._resources.get(resource)
        return state.all_devices if state is not None else {}

    def healthy(self, resource: str) -> Set[str]:
        """The healthy IDs, not copied: read them before the next change. Every change replaces the set (never
        changes it in place), so callers may cache what they derive from it by identity."""
        state = self._resources.get(resource)
        return state.healthy if state is not None else frozenset()

    def healthy_ids(self, resource: str) -> set[str]:
        return set(self.healthy(resource))

    def plugin_listed(self, resource: str) -> bool:
        """A plugin is connected and the devices shown are its list (its first ListAndWatch message came, even an
        empty one): a plugin back after a restart, what the startup plugin wait waits for."""
        state = self._resources.get(resource)
        return state is not None and state.connected and state.primary is not None and state.primary.listed

    def registered_healthy(self) -> dict[str, list[str]]:
        """The checkpoint's RegisteredDevices: every resource, with its healthy IDs (sorted, for stable bytes; the
        lists are shared, read them only)."""
        return {name: state.sorted_healthy() for name, state in self._resources.items()}
