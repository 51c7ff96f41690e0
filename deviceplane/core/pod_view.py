"""Build the pods view (`/api/v1/pods`) and who holds each device (for the devices view) from the pod table, the
allocations and the registry: pure, next to core/view.py."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from deviceplane.api.models import AllocatedTo
from deviceplane.core.pod_devices import Allocation, PodDevices
from deviceplane.core.pod_table import PodRecord, PodState, PodTable, SourceError
from deviceplane.core.registry import DeviceRegistry


class AllocationHolders:
    """Who holds each device, from the agent's own allocations' index (core.view.Holders). A pod restored from the
    checkpoint that no source knows (yet) is shown by its UID alone."""

    def __init__(self, pod_devices: PodDevices, table: PodTable) -> None:
        self._pod_devices = pod_devices
        self._table = table

    def allocated_count(self, resource: str) -> int:
        return self._pod_devices.allocated_count(resource)

    def held(self, resource: str) -> Collection[str]:
        return self._pod_devices.allocated(resource)

    def holder(self, resource: str, device_id: str) -> AllocatedTo | None:
        holder = self._pod_devices.holder(resource, device_id)
        if holder is None:
            return None
        uid, container = holder
        record = self._table.get(uid)
        if record is None:
            return AllocatedTo(namespace="", pod=uid, container=container)
        return AllocatedTo(namespace=record.pod.namespace, pod=record.pod.name, container=container)


def _resource_status(registry: DeviceRegistry, held: dict[str, Allocation]) -> list[dict[str, Any]]:
    """Per resource, each device's health as its plugin last reported it; unknown devices count as Healthy
    (spec §8: the device manager never reports Unknown)."""
    out = []
    for resource, allocation in sorted(held.items()):
        devices = registry.devices(resource)
        out.append(
            {
                "name": resource,
                "resources": [
                    {
                        "resourceID": device_id,
                        "health": "Unhealthy"
                        if device_id in devices and not devices[device_id].is_healthy
                        else "Healthy",
                    }
                    for device_id in sorted(allocation.device_ids)
                ],
            }
        )
    return out


def _pod_json(record: PodRecord, pod_devices: PodDevices, registry: DeviceRegistry) -> dict[str, Any]:
    pod = record.pod
    containers = []
    for container in pod.all_containers:
        held = pod_devices.container_allocations(pod.uid, container.name)
        options = pod_devices.run_options(pod.uid, container.name, [r for r, _ in container.limits])
        containers.append(
            {
                "name": container.name,
                "type": container.kind,
                "devices": {r: sorted(a.device_ids) for r, a in held.items()},
                "runOptions": options.to_json() if options is not None else None,
                # KEP-4680 allocatedResourcesStatus: app containers only, as the kubelet fills it
                "allocatedResourcesStatus": None if container.init else _resource_status(registry, held),
            }
        )
    return {
        "namespace": pod.namespace,
        "name": pod.name,
        "uid": pod.uid,
        "source": f"{record.source}:{record.key}",
        "phase": pod.phase,
        "state": str(record.state),
        "admitted": record.state == PodState.ADMITTED,
        "restored": record.restored,
        "reason": record.reason,
        "containers": containers,
    }


def _error_json(error: SourceError) -> dict[str, Any]:
    return {
        "namespace": None,
        "name": None,
        "uid": None,
        "source": f"{error.source}:{error.key}",
        "phase": None,
        "state": "invalid",
        "admitted": False,
        "restored": False,
        "reason": error.error,
        "containers": [],
    }


def pods_view(table: PodTable, pod_devices: PodDevices, registry: DeviceRegistry) -> list[dict[str, Any]]:
    """Every pod by namespace and name, then every object a source could not turn into a pod."""
    pods = [_pod_json(record, pod_devices, registry) for record in table.records()]
    return pods + [_error_json(error) for error in table.errors()]
