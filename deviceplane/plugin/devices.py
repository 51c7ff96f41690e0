"""The plugin's current device list and its fan-out to every ListAndWatch stream.

`replace()` may be called from any thread (sync plugins update health from their own threads), so the snapshot is
guarded by a lock and hand-off to the event loop goes through `call_soon_threadsafe` *while holding the lock*: that
keeps the order in which streams see snapshots equal to the order of `replace()` calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.plugin.models import Device

# A stream that falls this many snapshots behind only gets the newest: each snapshot replaces the previous one
# entirely (spec §1.4), so skipping stale intermediate ones is safe and bounds memory for a stuck reader.
MAX_BACKLOG = 256


# gRPC's default limit on a message received, which the kubelet keeps for ListAndWatch: a bigger snapshot ends the
# stream there (ResourceExhausted, in the kubelet's log only), and the node keeps the last list it read, unhealthy.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class DeviceListTooLarge(ValueError):
    """The device list does not fit in one ListAndWatch message the kubelet can receive."""


def list_and_watch_message(devices: Sequence[Device]) -> pb.ListAndWatchResponse:
    """The ListAndWatch message for `devices`; DeviceListTooLarge when it is over MAX_MESSAGE_BYTES."""
    message = pb.ListAndWatchResponse(devices=[d.to_proto() for d in devices])
    size = message.ByteSize()
    if size > MAX_MESSAGE_BYTES:
        raise DeviceListTooLarge(
            f"{len(devices)} devices make a {size}-byte ListAndWatch message, over the kubelet's limit of "
            f"{MAX_MESSAGE_BYTES} bytes (4 MiB, gRPC's default): fewer devices or shorter ids"
        )
    return message


@dataclass(frozen=True)
class Snapshot:
    version: int
    devices: tuple[Device, ...]
    by_id: Mapping[str, Device]
    message: pb.ListAndWatchResponse  # built once, shared by every stream


def _snapshot(version: int, devices: tuple[Device, ...]) -> Snapshot:
    by_id: dict[str, Device] = {}
    for device in devices:
        if not isinstance(device, Device):
            raise TypeError(f"devices must be deviceplane.plugin.Device, got {type(device).__name__}")
        if device.id in by_id:
            raise ValueError(f"duplicate device id {device.id!r}")
        by_id[device.id] = device
    return Snapshot(version, devices, MappingProxyType(by_id), list_and_watch_message(devices))


class DeviceSet:
    def __init__(self, devices: Iterable[Device] = ()) -> None:
        self._lock = threading.Lock()
        self._current = _snapshot(0, tuple(devices))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: set[asyncio.Queue[Snapshot | None]] = set()

    @property
    def current(self) -> Snapshot:
        return self._current

    @property
    def streams(self) -> int:
        """How many watch() iterators (ListAndWatch streams) are open now."""
        return len(self._queues)

    def replace(self, devices: Iterable[Device]) -> bool:
        """Make `devices` the device list; False (and nothing streamed) when it equals the current one."""
        new = tuple(devices)
        with self._lock:
            if new == self._current.devices:
                return False
            self._current = _snapshot(self._current.version + 1, new)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fan_out, self._current)
            return True

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        with self._lock:
            self._loop = loop

    def close(self) -> None:
        """End every stream (called on the loop when the plugin stops)."""
        with self._lock:
            self._loop = None
        for queue in self._queues:
            queue.put_nowait(None)

    def _fan_out(self, snapshot: Snapshot) -> None:
        for queue in self._queues:
            if queue.qsize() >= MAX_BACKLOG:
                while not queue.empty():
                    queue.get_nowait()
            queue.put_nowait(snapshot)

    async def watch(self) -> AsyncGenerator[Snapshot, None]:
        """The current snapshot, then every later one, until close(). Must run on the attached loop."""
        queue: asyncio.Queue[Snapshot | None] = asyncio.Queue()
        with self._lock:
            first = self._current
            self._queues.add(queue)
        try:
            yield first
            sent = first.version
            while (snapshot := await queue.get()) is not None:
                # A fan-out scheduled before we subscribed may still arrive: never go back in time.
                if snapshot.version > sent:
                    sent = snapshot.version
                    yield snapshot
        finally:
            self._queues.discard(queue)
