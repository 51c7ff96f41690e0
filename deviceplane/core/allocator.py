"""Choosing devices for a container: upstream `devicesToAllocate`, `filterByAffinity` and the init-container reuse
pool (spec §4.7), pure.

GetPreferredAllocation is an RPC in the middle of upstream's algorithm. Here the algorithm is a function of the
current state and, optionally, the plugin's answer: called without an answer it either decides, or says which
question to ask (`AskPreferred`); called again with the answer it re-runs every check against the state *as it is
then* and uses the answer only where it is still free. The caller reserves the chosen devices in the same step
(no await in between), so two admissions running concurrently can never pick the same device — the race upstream
still has (kubernetes#137534).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Set
from dataclasses import dataclass, field
from enum import StrEnum

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
from deviceplane.core.free_devices import FreeDevices, NaturalOrder, Rank, natural_key, natural_sorted
from deviceplane.core.pod_devices import Allocation, PodDevices, devices_per_numa, make_allocation
from deviceplane.core.registry import Device, DeviceRegistry, Endpoint
from deviceplane.core.topology import ResourceDevices, has_topology, mask_of


class AllocationResult(StrEnum):
    """The `result` label of `deviceplane_allocations_total`: one success per allocated container resource, one
    failure per failed admission (README, metrics table)."""

    SUCCESS = "success"
    UNREGISTERED = "unregistered"  # no plugin serves the resource
    UNHEALTHY = "unhealthy"  # no healthy device, or a held device turned unhealthy
    UNAVAILABLE = "unavailable"  # not enough free healthy devices
    TOPOLOGY = "topology"  # the topology policy found no acceptable NUMA affinity
    CHANGED_REQUEST = "changed_request"  # a restored container asks for a different count
    NO_ENDPOINT = "no_endpoint"  # the resource's plugin is not connected when its RPC is due
    TIMEOUT = "timeout"  # Allocate passed its deadline
    RPC_ERROR = "rpc_error"  # Allocate failed
    EMPTY_RESPONSE = "empty_response"  # Allocate answered without a container response
    PREFERRED_RPC_ERROR = "preferred_rpc_error"  # GetPreferredAllocation failed
    PRE_START_ERROR = "pre_start_error"  # PreStartContainer failed
    INTERNAL = "internal"  # a bug in the agent (resource_name empty, or the resource whose state it found broken)


class AllocationError(Exception):
    """Admission of a container failed; `str()` is upstream's exact message, `kind` the metric's result label and
    `resource` the resource it is counted under."""

    def __init__(self, message: str, kind: AllocationResult, resource: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.resource = resource


@dataclass(frozen=True, slots=True)
class AskPreferred:
    """Ask the plugin GetPreferredAllocation(available, must_include, size), then decide again with its answer."""

    available: tuple[str, ...]
    must_include: tuple[str, ...]
    size: int


@dataclass(frozen=True, slots=True)
class Chosen:
    """The devices to allocate; empty when nothing needs allocating (already held, or zero requested)."""

    devices: tuple[str, ...]


Decision = AskPreferred | Chosen


def filter_by_affinity(
    affinity: int | None, devices: Mapping[str, Device], available: Collection[str]
) -> tuple[set[str], set[str], set[str]]:
    """Upstream filterByAffinity (spec §4.7.4): (aligned, unaligned, without topology)."""
    if affinity is None or not has_topology(devices):
        return set(), set(), set(available)
    per_node = devices_per_numa(available, devices)

    def in_mask(node: int) -> bool:
        return node >= 0 and bool(affinity & (1 << node))

    ordered = sorted(
        per_node,
        # nodes in the affinity first, then other real nodes, then "no topology"; fewest devices first in each
        key=lambda n: (0 if in_mask(n) else 1 if n != NODE_WITHOUT_TOPOLOGY else 2, len(per_node[n]), n),
    )
    aligned: set[str] = set()
    unaligned: set[str] = set()
    without: set[str] = set()
    placed: set[str] = set()
    for node in ordered:
        for device_id in per_node[node]:
            if device_id in placed:
                continue
            placed.add(device_id)
            if in_mask(node):
                aligned.add(device_id)
            elif node == NODE_WITHOUT_TOPOLOGY:
                without.add(device_id)
            else:
                unaligned.add(device_id)
    return aligned, unaligned, without


@dataclass(slots=True)
class _Taker:
    """Upstream's take(): walk candidates not yet chosen until `needed` reaches 0."""

    needed: int
    rank: Rank
    chosen: list[str] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    def take(self, candidates: Collection[str]) -> bool:
        if self.needed > 0:
            fresh = [d for d in candidates if d not in self._seen] if self._seen else candidates
            for device_id in heapq.nsmallest(self.needed, fresh, key=self.rank.__getitem__):
                self._seen.add(device_id)
                self.chosen.append(device_id)
                self.needed -= 1
        return self.needed <= 0

    @property
    def taken(self) -> set[str]:
        return set(self._seen)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What device choice derives from one device snapshot of a resource (the registry replaces the dict)."""

    devices: Mapping[str, Device]
    ids: tuple[str, ...]  # the snapshot's IDs, in its order: the next snapshot with the same keeps `order`
    order: NaturalOrder
    has_topology: bool


class Allocator:
    """Devices held (`PodDevices`) plus devices reserved by admissions in flight, and the choice between them.

    The common request (no init container's devices to reuse, no NUMA affinity to honour) is answered from an index
    of the free devices per resource, kept current here on every reserve, commit and release. Changes made to
    `PodDevices` by others (checkpoint load, journal replay) show in its generation and drop the indexes.
    """

    def __init__(self, registry: DeviceRegistry, pod_devices: PodDevices) -> None:
        self._registry = registry
        self._pod_devices = pod_devices
        self._reserved: dict[tuple[str, str, str], tuple[str, ...]] = {}
        self._reserved_refs: dict[str, Counter[str]] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._free: dict[str, FreeDevices] = {}  # built on a resource's first allocation
        self._synced_generation = pod_devices.generation  # the PodDevices state the indexes reflect

    # -- bookkeeping ------------------------------------------------------------------------------------------------

    def is_device_plugin_resource(self, resource: str) -> bool:
        """Upstream: a key of healthyDevices or of allocatedDevices."""
        return resource in self._registry or bool(self._pod_devices.allocated_count(resource))

    def held(self, pod_uid: str, container: str, resource: str) -> frozenset[str] | None:
        """The devices a container holds of a resource; None when it has no entry."""
        return self._pod_devices.container_devices(pod_uid, container, resource)

    def held_by_container(self, pod_uid: str, container: str) -> dict[str, Allocation]:
        return self._pod_devices.container_allocations(pod_uid, container)

    def is_restored(self, pod_uid: str, containers: Iterable[tuple[str, Iterable[tuple[str, int]]]]) -> bool:
        return check_restored(self._pod_devices, pod_uid, containers)

    def plugin_endpoint(self, resource: str) -> Endpoint | None:
        return self._registry.primary_endpoint(resource)

    def allocated(self, resource: str) -> set[str]:
        """Held by a pod, or reserved by an admission in flight."""
        held = self._pod_devices.allocated(resource)
        reserved = self._reserved_refs.get(resource)
        if reserved:
            held.update(reserved)
        return held

    def reserve(self, pod_uid: str, container: str, resource: str, devices: Iterable[str]) -> None:
        key = (pod_uid, container, resource)
        self.unreserve(*key)
        chosen = tuple(devices)
        self._reserved[key] = chosen
        self._reserved_refs.setdefault(resource, Counter()).update(chosen)
        self._refresh(resource, chosen)

    def unreserve(self, pod_uid: str, container: str, resource: str) -> None:
        chosen = self._reserved.pop((pod_uid, container, resource), None)
        if chosen is not None:
            refs = self._reserved_refs[resource]
            refs.subtract(chosen)
            for device_id in chosen:
                if refs[device_id] <= 0:
                    del refs[device_id]
            self._refresh(resource, chosen)

    def commit(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        devices: Iterable[str],
        response: pb.ContainerAllocateResponse,
    ) -> None:
        """The plugin accepted the allocation: the reservation becomes the container's entry."""
        self._sync()
        chosen = tuple(devices)
        replaced = self._pod_devices.container_devices(pod_uid, container, resource) or ()
        per_numa = devices_per_numa(chosen, self._registry.devices(resource))
        self._pod_devices.insert(make_allocation(pod_uid, container, resource, per_numa, response))
        self._synced_generation = self._pod_devices.generation
        self.unreserve(pod_uid, container, resource)
        self._refresh(resource, (*chosen, *replaced))

    def release_pod(self, pod_uid: str) -> list[Allocation]:
        """Forget everything a pod holds or has reserved; returns the entries it held."""
        self._sync()
        for key in [k for k in self._reserved if k[0] == pod_uid]:
            self.unreserve(*key)
        removed = self._pod_devices.remove_pod(pod_uid)
        self._synced_generation = self._pod_devices.generation
        for allocation in removed:
            self._refresh(allocation.resource, allocation.device_ids)
        return removed

    def resource_devices(self, resource: str) -> ResourceDevices:
        return ResourceDevices(
            self._registry.devices(resource), self._registry.healthy(resource), self.allocated(resource)
        )

    # -- the free-device index --------------------------------------------------------------------------------------

    def _snapshot(self, resource: str, devices: Mapping[str, Device]) -> _Snapshot:
        cached = self._snapshots.get(resource)
        if cached is None or cached.devices is not devices:
            ids = tuple(devices)
            # A health change keeps the IDs, and the order: with the index, rebuilding it made the next admission
            # 5.7-6 ms longer at 10,000 devices (benchmarks/snapshot_churn.py).
            order = cached.order if cached is not None and cached.ids == ids else NaturalOrder(ids)
            cached = _Snapshot(devices, ids, order, has_topology(devices))
            self._snapshots[resource] = cached
        return cached

    def _sync(self) -> None:
        """Drop the indexes if someone else changed `PodDevices` since they were last brought up to date."""
        if self._pod_devices.generation != self._synced_generation:
            self._free.clear()
            self._synced_generation = self._pod_devices.generation

    def _free_devices(self, resource: str, order: NaturalOrder, healthy: Set[str]) -> FreeDevices:
        self._sync()
        free = self._free.get(resource)
        if free is not None and free.is_for(order, healthy):
            return free
        if free is not None and free.orders_by(order):
            # Only health changed: update the devices whose health did rather than rebuild (O(devices log devices)).
            for device_id in free.rebase(healthy):
                free.update(device_id, self._is_free(resource, device_id, healthy))
            return free
        taken = self.allocated(resource)
        free = FreeDevices(order, healthy, (d for d in healthy if d not in taken))
        self._free[resource] = free
        return free

    def _is_free(self, resource: str, device_id: str, healthy: Set[str]) -> bool:
        return (
            device_id in healthy
            and not self._pod_devices.holds(resource, device_id)
            and device_id not in self._reserved_refs.get(resource, ())
        )

    def _refresh(self, resource: str, device_ids: Iterable[str]) -> None:
        """Bring the resource's index up to date for devices whose holders or reservations just changed."""
        free = self._free.get(resource)
        if free is not None:
            healthy = self._registry.healthy(resource)
            for device_id in device_ids:
                free.update(device_id, self._is_free(resource, device_id, healthy))

    # -- the algorithm ----------------------------------------------------------------------------------------------

    def devices_to_allocate(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        required: int,
        reusable: Collection[str] = (),
        affinity: int | None = None,
        preferred: Collection[str] | None = None,
    ) -> Decision:
        """Upstream devicesToAllocate (spec §4.7.3), check order and error strings exact.

        `preferred` is the plugin's GetPreferredAllocation answer once asked (possibly empty); None means not asked
        yet, and the answer is `AskPreferred` when the plugin offers the RPC and the algorithm needs it.
        """
        held = self._pod_devices.container_devices(pod_uid, container, resource)
        needed = required
        if held is not None:
            needed = required - len(held)
            if needed != 0:
                raise AllocationError(
                    f'pod "{pod_uid}" container "{container}" changed request for resource "{resource}" '
                    f"from {len(held)} to {required}",
                    AllocationResult.CHANGED_REQUEST,
                    resource,
                )
        # Upstream step 2 (a container still running while sources are not ready) has no equivalent: restored pods
        # are recognised before allocation (see agent.admission), so this is never asked for one.
        if resource not in self._registry:
            self._free.pop(resource, None)  # an expired resource's index; a new plugin brings new devices
            self._snapshots.pop(resource, None)
            raise AllocationError(
                f"cannot allocate unregistered device {resource}", AllocationResult.UNREGISTERED, resource
            )
        healthy = self._registry.healthy(resource)
        all_devices = self._registry.devices(resource)
        if not healthy:
            raise AllocationError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}",
                AllocationResult.UNHEALTHY,
                resource,
            )
        if held is not None and not held <= healthy:
            raise AllocationError(
                f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {resource}",
                AllocationResult.UNHEALTHY,
                resource,
            )
        if needed == 0:
            return Chosen(())

        snapshot = self._snapshot(resource, all_devices)
        if not reusable and (affinity is None or not snapshot.has_topology):
            # One pool, all free devices in natural order (filterByAffinity's "without topology"): from the index.
            return self._first_free(resource, required, needed, snapshot.order, healthy, preferred)
        taker = _Taker(needed, snapshot.order.rank)
        if taker.take(reusable):
            return Chosen(tuple(taker.chosen))
        unavailable = self.allocated(resource)
        unavailable |= taker.taken
        available = healthy - unavailable
        if len(available) < taker.needed:
            raise _unavailable(resource, taker.needed, len(available))
        aligned, unaligned, without = filter_by_affinity(affinity, all_devices, available)
        offers_preferred = self._offers_preferred(resource)

        def ask(pool: Collection[str]) -> AskPreferred | None:
            if preferred is not None or not offers_preferred:
                return None
            # Plain string order: the plugin gets a set (Go map order upstream); sorting naturally costs too much here.
            return AskPreferred(tuple(sorted(set(pool) | taker.taken)), tuple(sorted(taker.taken)), required)

        answer = set(preferred or ())
        if taker.needed < len(aligned):
            question = ask(aligned)
            if question is not None:
                return question
            taker.take(answer & aligned)
            taker.take(aligned)
        else:
            # Upstream returns here when the aligned devices complete the request, before asking the plugin (the
            # spec's step 12 leaves this out): no GetPreferredAllocation is made then, so none can fail.
            if taker.take(aligned):
                return Chosen(tuple(taker.chosen))
            question = ask(available)
            if question is not None:
                return question
            taker.take(answer & available)
            taker.take(unaligned)
            taker.take(without)
        if taker.needed > 0:
            raise AllocationError(
                "unexpectedly allocated less resources than required. "
                f"Requested: {required}, Got: {required - taker.needed}",
                AllocationResult.UNAVAILABLE,
                resource,
            )
        return Chosen(tuple(taker.chosen))

    def _first_free(
        self,
        resource: str,
        required: int,
        needed: int,
        order: NaturalOrder,
        healthy: Set[str],
        preferred: Collection[str] | None,
    ) -> Decision:
        """devicesToAllocate's steps 9-12 when nothing is reused and no affinity applies: the preferred devices
        still free, then the first free ones in natural order. O(request · log devices), except the question to
        the plugin, which lists every free device."""
        free = self._free_devices(resource, order, healthy)
        if len(free) < needed:
            raise _unavailable(resource, needed, len(free))
        if preferred is None:
            if self._offers_preferred(resource):
                return AskPreferred(free.plain_sorted(), (), required)
            return Chosen(tuple(free.first(needed)))
        chosen = free.first_of(preferred, needed)
        chosen += free.first(needed - len(chosen), skip=chosen)
        return Chosen(tuple(chosen))

    def _offers_preferred(self, resource: str) -> bool:
        endpoint = self._registry.primary_endpoint(resource)
        return bool(
            endpoint is not None
            and endpoint.options is not None
            and endpoint.options.get_preferred_allocation_available
        )


def _unavailable(resource: str, needed: int, available: int) -> AllocationError:
    return AllocationError(
        f"requested number of devices unavailable for {resource}. Requested: {needed}, Available: {available}",
        AllocationResult.UNAVAILABLE,
        resource,
    )


@dataclass(slots=True)
class ReusePool:
    """Upstream devicesToReuse for one pod (spec §4.7.1): a regular init container's devices can be taken again by
    the containers after it; a restartable init container (sidecar) and app containers keep theirs."""

    devices: dict[str, set[str]] = field(default_factory=dict)

    def get(self, resource: str) -> set[str]:
        return set(self.devices.get(resource, ()))

    def after_container(self, allocations: Mapping[str, Allocation], init: bool, restartable: bool) -> None:
        for resource, allocation in allocations.items():
            pool = self.devices.setdefault(resource, set())
            if init and not restartable:
                pool |= allocation.device_ids
            else:
                pool -= allocation.device_ids


def check_restored(
    pod_devices: PodDevices, pod_uid: str, containers: Iterable[tuple[str, Iterable[tuple[str, int]]]]
) -> bool:
    """Whether a pod's checkpointed entries already cover every non-zero device request of every container: such
    a pod was admitted before an agent restart, and keeps its devices without any RPC (the kubelet's
    "container already running" case)."""
    any_entry = False
    for name, limits in containers:
        for resource, count in limits:
            if count == 0:
                continue
            held = pod_devices.container_devices(pod_uid, name, resource)
            if held is None or len(held) != count:
                return False
            any_entry = True
    return any_entry


__all__ = [
    "AllocationError",
    "AllocationResult",
    "Allocator",
    "AskPreferred",
    "Chosen",
    "Decision",
    "ReusePool",
    "check_restored",
    "filter_by_affinity",
    "mask_of",
    "natural_key",
    "natural_sorted",
]
