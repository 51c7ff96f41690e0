"""What the kubelet's ListAndWatch on one proxy endpoint streams.

The primary plugin connection's latest message, unchanged. While no plugin is connected, the last message sent with
every device Unhealthy: the kubelet stops allocating them (as its own disconnect handling would) but its stream stays
open, so a plugin that comes back - on the same socket or another one - takes over without a disconnect. Snapshots
are full replacements, so a slow reader only ever needs the newest one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.constants import UNHEALTHY


def all_unhealthy(message: pb.ListAndWatchResponse) -> pb.ListAndWatchResponse:
    """The same devices (and topology, absent where it was absent), every one Unhealthy."""
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(ID=d.ID, health=UNHEALTHY, topology=d.topology if d.HasField("topology") else None)
            for d in message.devices
        ]
    )


class SnapshotFeed:
    def __init__(self) -> None:
        self._current: pb.ListAndWatchResponse | None = None
        self._wire = b""  # _current serialized once for every reader
        self._version = 0
        self._changed = asyncio.Event()
        self._closed = False
        self._streams_ended = 0  # bumped by end_streams: the streams following before it end
        self._inputs: tuple[pb.ListAndWatchResponse | None, bool] | None = None

    @property
    def current(self) -> pb.ListAndWatchResponse | None:
        return self._current

    def show(self, primary_message: pb.ListAndWatchResponse | None, connected: bool) -> bool:
        """Set what readers see from the registry's state; True when that changed. Cheap when nothing did (it runs
        on every tick): the same inputs as last time return at once."""
        if self._inputs is not None and self._inputs[0] is primary_message and self._inputs[1] == connected:
            return False  # identity, not value: comparing big snapshots every tick would cost
        self._inputs = (primary_message, connected)
        if connected:
            if primary_message is None:
                return False  # a new plugin before its first message: keep showing what we had
            desired = primary_message
        elif self._current is not None:
            desired = all_unhealthy(self._current)
        else:
            return False
        if desired is self._current or desired == self._current:
            return False
        self._publish(desired)
        return True

    def _publish(self, message: pb.ListAndWatchResponse) -> None:
        self._current = message
        self._wire = message.SerializeToString()
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        self._closed = True
        self._changed.set()

    def end_streams(self) -> None:
        """End the streams following now, as a plugin's ending would; streams that start later follow as usual."""
        self._streams_ended += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self) -> AsyncIterator[bytes]:
        """The current snapshot (once there is one), then every newer one, until closed or ended."""
        seen = 0
        generation = self._streams_ended
        while not self._closed and self._streams_ended == generation:
            changed = self._changed
            if self._version > seen:
                seen = self._version
                yield self._wire
                continue
            await changed.wait()
