"""The allocator's device choice as it was before the free-device index (main at 2a69658), copied verbatim: the
oracle of tests/unit/test_allocator_differential.py and the "old" side of benchmarks/choice.py. Test code only.

Only the class is renamed (`OracleAllocator`); the error, decision and result types are the product's, so results
compare with `==` and `AllocationError`s by message, kind and resource.
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core import ordering
from deviceplane.core.allocator import (
    AllocationError,
    AllocationResult,
    AskPreferred,
    Chosen,
    Decision,
    check_restored,
)
from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
from deviceplane.core.pod_devices import Allocation, PodDevices, devices_per_numa, make_allocation
from deviceplane.core.registry import Device, DeviceRegistry, Endpoint
from deviceplane.core.topology import ResourceDevices, has_topology

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


class OracleAllocator:
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
