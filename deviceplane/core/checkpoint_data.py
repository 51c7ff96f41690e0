"""The checkpoint's data model: upstream `checkpoint.checkpointData` and `PodDevicesEntry` (spec §4.9). The codec
(core/checkpoint.py) and the checksum text (core/spew.py) both build on it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DevicesPerNuma = Mapping[int, list[str] | None]  # NUMA node id (-1: no topology) -> device IDs
DevicesByResource = Mapping[str, list[str] | None]  # resource name -> device IDs


# -- model: field names are upstream's Go field names, which are also the JSON keys ----------------------------------


@dataclass(frozen=True)
class PodDevicesEntry:
    """The devices of one resource held by one container (upstream `checkpoint.PodDevicesEntry`)."""

    PodUID: str
    ContainerName: str
    ResourceName: str
    DeviceIDs: DevicesPerNuma | None
    AllocResp: bytes | None  # the plugin's ContainerAllocateResponse, proto3 binary

    def devices(self) -> set[str]:
        """Every device ID, all NUMA nodes together (upstream `DevicesPerNUMA.Devices`)."""
        return {device for ids in (self.DeviceIDs or {}).values() for device in ids or ()}


@dataclass(frozen=True)
class CheckpointData:
    """Upstream `checkpoint.checkpointData`: what the file stores, and what the checksum covers."""

    PodDeviceEntries: list[PodDevicesEntry] | None = None
    # Resource -> its healthy device IDs at write time. On read only the keys matter (resources come back stopped).
    RegisteredDevices: DevicesByResource | None = None
