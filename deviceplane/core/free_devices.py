"""The free devices of one resource (healthy, held by no container, reserved by no admission in flight), the first
ones in natural order on demand, pure.

Device choice asks for the first few free devices of a resource, once per container. Recomputing `healthy - held`
and ranking every candidate costs O(devices) each time; this index answers in O(request · log devices): a heap of
natural-order positions with lazy deletion, kept current by the allocator as it reserves, commits and releases, and
rebuilt when a snapshot replaces the resource's devices or health.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterable, Set

from deviceplane.core import ordering

natural_key = ordering.cached_natural_key


def natural_sorted(ids: Iterable[str]) -> list[str]:
    return sorted(ids, key=natural_key)


class Rank(dict[str, int]):
    """Device -> position in natural order; unknown IDs sort last. A dict so that lookups stay in C."""

    def __missing__(self, _key: str) -> int:
        return len(self)


class NaturalOrder:
    """One device snapshot's IDs in natural order (ties keep the snapshot's order), and each one's position."""

    __slots__ = ("ids", "rank")

    def __init__(self, devices: Iterable[str]) -> None:
        self.ids = natural_sorted(devices)
        self.rank = Rank(zip(self.ids, range(len(self.ids)), strict=True))


class FreeDevices:
    """Free devices of one resource. The allocator says which devices changed (`update`); the index keeps, for
    every free device, its position in a heap, plus stale positions of devices no longer free, dropped when they
    surface (each position at most once in the heap, so it never grows beyond the snapshot's size), and the free
    IDs in plain string order."""

    def __init__(self, order: NaturalOrder, healthy: Set[str], free: Iterable[str]) -> None:
        self._order = order
        self._healthy = healthy
        self._free = {d for d in free if d in order.rank}
        self._heap = sorted(order.rank[d] for d in self._free)  # a sorted list is a heap
        # Plain string order, for GetPreferredAllocation's `available`: kept sorted (bisect, a C memmove per change)
        # rather than sorted again per question; built on the first question (a plugin without the RPC never asks).
        self._plain: list[str] | None = None
        self._queued = bytearray(len(order.ids))
        for position in self._heap:
            self._queued[position] = 1

    def is_for(self, order: NaturalOrder, healthy: Set[str]) -> bool:
        """Built from this snapshot and this health set (the registry replaces both objects on every change)."""
        return self._order is order and self._healthy is healthy

    def orders_by(self, order: NaturalOrder) -> bool:
        return self._order is order

    def rebase(self, healthy: Set[str]) -> Set[str]:
        """Take a new health set of the same snapshot order; returns the devices whose health changed, for the
        caller to `update`."""
        changed = self._healthy ^ healthy
        self._healthy = healthy
        return changed

    def __len__(self) -> int:
        return len(self._free)

    def update(self, device_id: str, free: bool) -> None:
        if not free:
            if device_id in self._free:
                self._free.remove(device_id)  # its heap entry goes stale, dropped when it surfaces
                if self._plain is not None:
                    del self._plain[bisect.bisect_left(self._plain, device_id)]
            return
        position = self._order.rank.get(device_id)
        if position is None or device_id in self._free:
            return
        self._free.add(device_id)
        if self._plain is not None:
            bisect.insort(self._plain, device_id)
        if not self._queued[position]:
            self._queued[position] = 1
            heapq.heappush(self._heap, position)

    def plain_sorted(self) -> tuple[str, ...]:
        """Every free device in plain string order (the GetPreferredAllocation request's `available`)."""
        if self._plain is None:
            self._plain = sorted(self._free)
        return tuple(self._plain)

    def first(self, count: int, skip: Collection[str] = ()) -> list[str]:
        """The first `count` free devices in natural order, leaving out `skip`."""
        out: list[str] = []
        kept: list[int] = []
        heap, ids = self._heap, self._order.ids
        while len(out) < count and heap:
            position = heapq.heappop(heap)
            device_id = ids[position]
            if device_id not in self._free:
                self._queued[position] = 0
                continue
            kept.append(position)
            if device_id not in skip:
                out.append(device_id)
        for position in kept:
            heapq.heappush(heap, position)
        return out

    def first_of(self, candidates: Iterable[str], count: int) -> list[str]:
        """The first `count` free devices among `candidates`, in natural order (unknown or taken IDs ignored)."""
        free = [d for d in set(candidates) if d in self._free]
        return heapq.nsmallest(count, free, key=self._order.rank.__getitem__)


__all__ = ["FreeDevices", "NaturalOrder", "Rank", "natural_key", "natural_sorted"]
