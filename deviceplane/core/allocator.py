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

import functools
import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core import ordering
from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
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
    INTERNAL = "internal"  # a bug in the agent (resource_name empty)


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


# Allocation sorts the same IDs again and again: cache their keys.
natural_key = functools.lru_cache(maxsize=1 << 16)(ordering.natural_key)


def natural_sorted(ids: Iterable[str]) -> list[str]:
    return sorted(ids, key=natural_key)


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


class _Rank(dict[str, int]):
    """Device -> position in natural order; unknown IDs sort last. A dict so that lookups stay in C."""

    def __missing__(self, _key: str) -> int:
        return len(self)


def _rank_of(devices: Iterable[str]) -> _Rank:
    rank = _Rank()
    for position, device_id in enumerate(natural_sorted(devices)):
        rank[device_id] = position
    return rank


@dataclass(slots=True)
class _Taker:
    """Upstream's take(): walk candidates not yet chosen until `needed` reaches 0."""

    needed: int
    rank: _Rank
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


class Allocator:
    """Devices held (`PodDevices`) plus devices reserved by admissions in flight, and the choice between them."""

    def __init__(self, registry: DeviceRegistry, pod_devices: PodDevices) -> None:
        self._registry = registry
        self._pod_devices = pod_devices
        self._reserved: dict[tuple[str, str, str], tuple[str, ...]] = {}
        self._reserved_refs: dict[str, Counter[str]] = {}
        # resource -> (the device dict it was computed from, natural-order rank); a snapshot replaces the dict
        self._ranks: dict[str, tuple[Mapping[str, Device], _Rank]] = {}

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

    def unreserve(self, pod_uid: str, container: str, resource: str) -> None:
        chosen = self._reserved.pop((pod_uid, container, resource), None)
        if chosen is not None:
            refs = self._reserved_refs[resource]
            refs.subtract(chosen)
            for device_id in chosen:
                if refs[device_id] <= 0:
                    del refs[device_id]

    def commit(
        self,
        pod_uid: str,
        container: str,
        resource: str,
        devices: Iterable[str],
        response: pb.ContainerAllocateResponse,
    ) -> None:
        """The plugin accepted the allocation: the reservation becomes the container's entry."""
        per_numa = devices_per_numa(devices, self._registry.devices(resource))
        self._pod_devices.insert(make_allocation(pod_uid, container, resource, per_numa, response))
        self.unreserve(pod_uid, container, resource)

    def release_pod(self, pod_uid: str) -> list[Allocation]:
        """Forget everything a pod holds or has reserved; returns the entries it held."""
        for key in [k for k in self._reserved if k[0] == pod_uid]:
            self.unreserve(*key)
        return self._pod_devices.remove_pod(pod_uid)

    def _rank(self, resource: str, devices: Mapping[str, Device]) -> _Rank:
        cached = self._ranks.get(resource)
        if cached is None or cached[0] is not devices:
            cached = (devices, _rank_of(devices))
            self._ranks[resource] = cached
        return cached[1]

    def resource_devices(self, resource: str) -> ResourceDevices:
        return ResourceDevices(
            self._registry.devices(resource), self._registry.healthy(resource), self.allocated(resource)
        )

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

        taker = _Taker(needed, self._rank(resource, all_devices))
        if taker.take(reusable):
            return Chosen(tuple(taker.chosen))
        unavailable = self.allocated(resource)
        unavailable |= taker.taken
        available = healthy - unavailable
        if len(available) < taker.needed:
            raise AllocationError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {taker.needed}, Available: {len(available)}",
                AllocationResult.UNAVAILABLE,
                resource,
            )
        aligned, unaligned, without = filter_by_affinity(affinity, all_devices, available)
        endpoint = self._registry.primary_endpoint(resource)
        offers_preferred = bool(
            endpoint is not None
            and endpoint.options is not None
            and endpoint.options.get_preferred_allocation_available
        )

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
            taker.take(aligned)
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
