"""What the device manager and the gRPC transport know of each other, as the kubelet separates
`plugin/v1beta1/handler.go` (transport) from `manager.go`.

- Transport → manager: the Registration service and the plugin watcher call a `PluginHandler`.
- Manager → transport: the manager dials plugins through a `PluginConnector`, getting `PluginConnection`s.
- Admission → manager: the admission runner finds a resource's connection through `PluginLookup` and calls
  only the per-allocation RPCs (`PluginRpc`).
- Manager → listeners: each change is told as a `DeviceEvent` to the listeners given at construction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.registry import Device, PluginOptions


class RegistrationError(Exception):
    """A registration the manager refused; the message is what the plugin is told."""


class PluginDialError(Exception):
    """A plugin could not be dialled, or did not answer GetDevicePluginOptions."""


class DeviceEventKind(StrEnum):
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"
    SNAPSHOT = "snapshot"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """What listeners (metrics, admission, publishers) hear after each change."""

    resource: str
    kind: DeviceEventKind
    transitions: tuple[str, ...] = ()  # IDs whose health flipped


DeviceListener = Callable[[DeviceEvent], None]
SnapshotCallback = Callable[[Sequence[Device]], None]
StreamEndCallback = Callable[[str], Awaitable[None]]


class PluginHandler(Protocol):
    async def register(self, resource: str, socket_path: str) -> None:
        """Connect to a plugin that registered; RegistrationError with what to tell it otherwise."""
        ...

    async def deregister(self, resource: str, socket_path: str, reason: str) -> bool:
        """Disconnect a plugin whose socket went away; False when it was not connected."""
        ...


class PluginRpc(Protocol):
    async def allocate(self, device_ids: Sequence[str], timeout: float | None) -> pb.AllocateResponse: ...

    async def get_preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, timeout: float | None
    ) -> pb.PreferredAllocationResponse: ...

    async def pre_start_container(self, device_ids: Sequence[str], timeout: float) -> None: ...


class PluginConnection(PluginRpc, Protocol):
    async def connect(self, timeout: float) -> PluginOptions:
        """Dial and ask for the plugin's options; PluginDialError when it cannot."""
        ...

    def start_stream(self, on_snapshot: SnapshotCallback, on_end: StreamEndCallback) -> None:
        """Follow ListAndWatch until it ends (then `on_end(reason)`) or the connection is closed."""
        ...

    async def close(self) -> None:
        """Stop the stream and close the connection now: calls in flight fail."""
        ...

    async def close_after_calls(self, limit: float) -> None:
        """Stop the stream now; close once the calls in flight have ended, or after `limit` seconds."""
        ...


PluginConnector = Callable[[str, str], PluginConnection]  # (resource, socket path) -> a not yet dialled connection


class PluginLookup(Protocol):
    def client(self, resource: str) -> PluginRpc | None:
        """The connection of the resource's primary plugin, while it is connected."""
        ...
