"""Which devices each pod's containers hold: upstream `podDevices` (spec §4.1, §4.9, §4.13, §6.3), pure.

Kept indexed so that every question an admission or a view asks is answered without walking all pods: each
resource's held devices, with who holds them, are maintained incrementally. A device can appear in several entries of
one pod (a regular init container's devices are reused by later containers), so the index keeps every holder.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from google.protobuf.message import DecodeError

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.checkpoint import PodDevicesEntry
from deviceplane.core.constants import NODE_WITHOUT_TOPOLOGY
from deviceplane.core.registry import Device
from deviceplane.core.run_options import RunOptions, merge_run_options

DevicesPerNuma = dict[int, tuple[str, ...]]
Holder = tuple[str, str]  # (pod UID, container)
# A held device's holders: the one holder (nearly always, and no set to keep per device), or a set of several.
Holders = Holder | set[Holder]


def devices_per_numa(device_ids: Iterable[str], known: Mapping[str, Device]) -> DevicesPerNuma:
    """Book each device under every NUMA node of its topology, or under -1 without one (spec §4.7.2)."""
    out: dict[int, list[str]] = {}
    for device_id in device_ids:
        device = known.get(device_id)
        keys = device.numa_keys if device is not None else (NODE_WITHOUT_TOPOLOGY,)
        for numa in keys:
            out.setdefault(numa, []).append(device_id)
    return {numa: tuple(ids) for numa, ids in sorted(out.items())}


@dataclass(frozen=True, slots=True)
class Allocation:
    """One container's devices of one resource, and the plugin's answer for them."""

    pod_uid: str
    container: str
    resource: str
    per_numa: DevicesPerNuma
    response: pb.ContainerAllocateResponse
    entry: PodDevicesEntry  # its checkpoint form, built once so a checkpoint snapshot is only a list copy
    device_ids: frozenset[str] = field(init=False, repr=False, compare=False)  # every NUMA node's IDs together

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_ids", frozenset(d for ids in self.per_numa.values() for d in ids))


def make_allocation(
    pod_uid: str, container: str, resource: str, per_numa: DevicesPerNuma, response: pb.ContainerAllocateResponse
) -> Allocation:
    entry = PodDevicesEntry(
        PodUID=pod_uid,
        ContainerName=container,
        ResourceName=resource,
        DeviceIDs={numa: list(ids) for numa, ids in per_numa.items()},
        AllocResp=response.SerializeToString(deterministic=True),
    )
    return Allocation(pod_uid, container, resource, per_numa, response, entry)


def allocation_from_entry(entry: PodDevicesEntry) -> Allocation | None:
    """A checkpoint entry back to an allocation; None when its response does not parse (upstream skips those).

    A null response is an empty one, as for upstream's `proto.Unmarshal(nil)`: the entry's devices stay held, and
    later checkpoints write it as upstream re-marshals it (`""`), not leave it out as an entry without a response."""
    if entry.AllocResp is None:
        entry = replace(entry, AllocResp=b"")
    response = pb.ContainerAllocateResponse()
    try:
        response.ParseFromString(entry.AllocResp or b"")
    except DecodeError:
        return None
    per_numa = {numa: tuple(ids or ()) for numa, ids in sorted((entry.DeviceIDs or {}).items())}
    return Allocation(entry.PodUID, entry.ContainerName, entry.ResourceName, per_numa, response, entry)


@dataclass(frozen=True, slots=True)
class DeviceInstance:
    """One row of the PodResources answer: a device on one NUMA node (numa None: no topology)."""

    resource: str
    device_id: str
    numa: int | None


class PodDevices:
    def __init__(self) -> None:
        # pod -> container -> resource -> allocation, insertion-ordered (admission order)
        self._pods: dict[str, dict[str, dict[str, Allocation]]] = {}
        # (pod, container, resource) -> checkpoint entry, in the order each was first made: `entries` is one copy of
        # it (the background checkpoint takes it on the event loop, where walking `_pods` and filtering the entries
        # was part of a 5-7 ms snapshot at 5,000 entries).
        self._entries: dict[tuple[str, str, str], PodDevicesEntry] = {}
        # resource -> device -> who holds it (every entry holding it)
        self._held: dict[str, dict[str, Holders]] = {}
        self._count = 0
        self._generation = 0
        # pod -> the generation its allocations last changed at (absent: it holds none)
        self._pod_generations: dict[str, int] = {}

    @property
    def generation(self) -> int:
        """Changes whenever an allocation is added or removed: a cheap "anything new?" for publishers."""
        return self._generation

    def pod_generation(self, pod_uid: str) -> int:
        """Changes whenever the pod's allocations do (0 while it holds none): what a reader keeps per pod stays valid
        while this is the same (PodResources' List keeps each pod's part encoded)."""
        return self._pod_generations.get(pod_uid, 0)

    def __len__(self) -> int:
        """Number of (pod, container, resource) entries."""
        return self._count

    # -- writes -----------------------------------------------------------------------------------------------------

    def insert(self, allocation: Allocation) -> None:
        containers = self._pods.setdefault(allocation.pod_uid, {})
        resources = containers.setdefault(allocation.container, {})
        old = resources.get(allocation.resource)
        if old is not None:
            self._unindex(old)
        else:
            self._count += 1
        resources[allocation.resource] = allocation
        self._entries[(allocation.pod_uid, allocation.container, allocation.resource)] = allocation.entry
        self._index(allocation)
        self._generation += 1
        self._pod_generations[allocation.pod_uid] = self._generation

    def remove_pod(self, pod_uid: str) -> list[Allocation]:
        containers = self._pods.pop(pod_uid, None)
        if containers is None:
            return []
        removed = [a for resources in containers.values() for a in resources.values()]
        for allocation in removed:
            self._unindex(allocation)
            del self._entries[(pod_uid, allocation.container, allocation.resource)]
        self._count -= len(removed)
        self._generation += 1
        self._pod_generations.pop(pod_uid, None)
        return removed

    def load(self, entries: Iterable[PodDevicesEntry]) -> int:
        """Restore from checkpoint entries (spec §4.9 read path); returns how many were skipped as unreadable."""
        skipped = 0
        for entry in entries:
            allocation = allocation_from_entry(entry)
            if allocation is None:
                skipped += 1
            else:
                self.insert(allocation)
        return skipped

    def _index(self, allocation: Allocation) -> None:
        held = self._held.setdefault(allocation.resource, {})
        holder = (allocation.pod_uid, allocation.container)
        for device_id in allocation.device_ids:
            current = held.get(device_id)
            if current is None:
                held[device_id] = holder
            elif isinstance(current, set):
                current.add(holder)
            elif current != holder:
                held[device_id] = {current, holder}

    def _unindex(self, allocation: Allocation) -> None:
        held = self._held.get(allocation.resource, {})
        holder = (allocation.pod_uid, allocation.container)
        for device_id in allocation.device_ids:
            current = held.get(device_id)
            if isinstance(current, set):
                current.discard(holder)
                if len(current) == 1:
                    held[device_id] = next(iter(current))
            elif current == holder:
                del held[device_id]

    # -- reads ------------------------------------------------------------------------------------------------------

    def pods(self) -> set[str]:
        return set(self._pods)

    def has_pod(self, pod_uid: str) -> bool:
        return pod_uid in self._pods

    def allocations(self, pod_uid: str) -> Iterator[Allocation]:
        for resources in self._pods.get(pod_uid, {}).values():
            yield from resources.values()

    def container_allocations(self, pod_uid: str, container: str) -> dict[str, Allocation]:
        return dict(self._pods.get(pod_uid, {}).get(container, {}))

    def container_devices(self, pod_uid: str, container: str, resource: str) -> frozenset[str] | None:
        """Upstream containerDevices: None when there is no entry."""
        allocation = self._pods.get(pod_uid, {}).get(container, {}).get(resource)
        return allocation.device_ids if allocation is not None else None

    def pod_devices(self, pod_uid: str, resource: str) -> set[str]:
        """Every device of `resource` held by any container of the pod (upstream podDevices(pod, resource))."""
        out: set[str] = set()
        for resources in self._pods.get(pod_uid, {}).values():
            allocation = resources.get(resource)
            if allocation is not None:
                out |= allocation.device_ids
        return out

    def allocated(self, resource: str) -> set[str]:
        return set(self._held.get(resource, {}))

    def holds(self, resource: str, device_id: str) -> bool:
        """Whether any entry holds the device."""
        held = self._held.get(resource)
        return held is not None and device_id in held

    def allocated_count(self, resource: str) -> int:
        return len(self._held.get(resource, {}))

    def devices(self) -> dict[str, set[str]]:
        """Upstream devices(): resource -> every allocated ID (recomputable allocatedDevices)."""
        return {resource: set(held) for resource, held in self._held.items() if held}

    def holders(self, resource: str, device_id: str) -> set[Holder]:
        """Every (pod, container) whose entry of `resource` holds the device."""
        current = self._held.get(resource, {}).get(device_id)
        if current is None:
            return set()
        return set(current) if isinstance(current, set) else {current}

    def holder(self, resource: str, device_id: str) -> Holder | None:
        """One (pod, container) holding the device, None when it is free. When several entries hold it (a regular
        init container's devices reused by a later container of the pod), the smallest (pod, container) pair wins,
        i.e. the container whose name sorts first, whichever kind it is."""
        current = self._held.get(resource, {}).get(device_id)
        return min(current) if isinstance(current, set) else current

    def entries(self, without_pods: Collection[str] = ()) -> list[PodDevicesEntry]:
        """Checkpoint entries (upstream toCheckpointData, whose order is Go's random map order), in the order each
        (pod, container, resource) entry was first made; none of the pods `without_pods`."""
        left_out = [
            (pod_uid, container, resource)
            for pod_uid in without_pods
            for container, resources in self._pods.get(pod_uid, {}).items()
            for resource in resources
        ]
        if not left_out:
            return list(self._entries.values())
        # A copy without a few keys, rather than a filter of every entry: reading each entry's pod on the event loop
        # cost ~2 ms at 5,000 entries (the objects are spread over the heap); copying the dict never touches them.
        kept = dict(self._entries)
        for key in left_out:
            del kept[key]
        return list(kept.values())

    def device_instances(self, pod_uid: str, container: str) -> list[DeviceInstance]:
        """Upstream GetDevices + containerDevicesFromResourceDeviceInstances: one row per device per NUMA node,
        rebuilt from the per-NUMA lists, -1 meaning no topology (spec §2, §4.13). Sorted for stable answers."""
        rows: list[DeviceInstance] = []
        for resource, allocation in sorted(self._pods.get(pod_uid, {}).get(container, {}).items()):
            nodes: dict[str, set[int]] = {}
            for numa, ids in allocation.per_numa.items():
                for device_id in ids:
                    found = nodes.setdefault(device_id, set())
                    if numa != NODE_WITHOUT_TOPOLOGY:
                        found.add(numa)
            for device_id in sorted(nodes):
                if not nodes[device_id]:
                    rows.append(DeviceInstance(resource, device_id, None))
                for numa in sorted(nodes[device_id]):
                    rows.append(DeviceInstance(resource, device_id, numa))
        return rows

    def run_option_conflicts(self, pod_uid: str, container: str, order: Iterable[str] = ()) -> list[str]:
        """What merging the container's run options would report as conflicting (spec §4.10), without merging when
        nothing can conflict: one response with at most one mount and one device (every other field is a map)."""
        resources = self._pods.get(pod_uid, {}).get(container)
        if not resources:
            return []
        if len(resources) == 1:
            (only,) = resources.values()
            if len(only.response.mounts) <= 1 and len(only.response.devices) <= 1:
                return []
        options = self.run_options(pod_uid, container, order)
        return options.conflicts if options is not None else []

    def run_options(self, pod_uid: str, container: str, order: Iterable[str] = ()) -> RunOptions | None:
        """Spec §4.10 deviceRunContainerOptions: None when the pod or container is unknown. Resources are merged in
        `order` first (the container's limit order), then any others by name."""
        resources = self._pods.get(pod_uid, {}).get(container)
        if resources is None:
            return None
        ordered = [r for r in order if r in resources]
        ordered += sorted(r for r in resources if r not in ordered)
        return merge_run_options((r, resources[r].response) for r in ordered)
