"""Merging a container's Allocate responses into its run options (spec §4.10 deviceRunContainerOptions).

Resources are visited in the order given (upstream uses Go map order; the caller passes the container's limit
order so the result is deterministic). The first value for a key wins; a different later value is a conflict,
which upstream only logs, so it is reported alongside the result, never raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb


@dataclass(frozen=True, slots=True)
class MountOption:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class DeviceOption:
    path_in_container: str
    path_on_host: str
    permissions: str


@dataclass(slots=True)
class RunOptions:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[MountOption] = field(default_factory=list)
    devices: list[DeviceOption] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "envs": dict(self.envs),
            "mounts": [
                {"containerPath": m.container_path, "hostPath": m.host_path, "readOnly": m.read_only}
                for m in self.mounts
            ],
            "devices": [
                {"containerPath": d.path_in_container, "hostPath": d.path_on_host, "permissions": d.permissions}
                for d in self.devices
            ],
            "annotations": dict(self.annotations),
            "cdiDevices": list(self.cdi_devices),
        }


def merge_run_options(responses: Iterable[tuple[str, pb.ContainerAllocateResponse]]) -> RunOptions:
    """Merge (resource, response) pairs, first wins (spec §4.10)."""
    out = RunOptions()
    mounts: dict[str, MountOption] = {}
    devices: dict[str, DeviceOption] = {}
    cdi_seen: set[str] = set()
    for resource, response in responses:
        for key, value in sorted(response.envs.items()):
            known = out.envs.get(key)
            if known is None:
                out.envs[key] = value
            elif known != value:
                out.conflicts.append(
                    f"Environment variable {key} has conflicting setting: {known} and {value} (from {resource})"
                )
        for mount in response.mounts:
            existing = mounts.get(mount.container_path)
            if existing is None:
                mounts[mount.container_path] = MountOption(mount.container_path, mount.host_path, mount.read_only)
            elif existing.host_path != mount.host_path:
                out.conflicts.append(
                    f"Container path {mount.container_path} has conflicting mount host paths: "
                    f"{existing.host_path} and {mount.host_path} (from {resource})"
                )
        for device in response.devices:
            known_device = devices.get(device.container_path)
            if known_device is None:
                devices[device.container_path] = DeviceOption(
                    device.container_path, device.host_path, device.permissions
                )
            elif known_device.path_on_host != device.host_path:
                out.conflicts.append(
                    f"Container device {device.container_path} has conflicting mapping host devices: "
                    f"{known_device.path_on_host} and {device.host_path} (from {resource})"
                )
        for key, value in sorted(response.annotations.items()):
            known = out.annotations.get(key)
            if known is None:
                out.annotations[key] = value
            elif known != value:
                out.conflicts.append(f"Annotation {key} has conflicting setting: {known} and {value} (from {resource})")
        for cdi in response.cdi_devices:
            if cdi.name not in cdi_seen:
                cdi_seen.add(cdi.name)
                out.cdi_devices.append(cdi.name)
    out.mounts = list(mounts.values())
    out.devices = list(devices.values())
    return out
