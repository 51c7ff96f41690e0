"""The device manager: core bookkeeping driven by real plugin connections, persisted to the kubelet checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from deviceplane.agent.plugins.contracts import (
    DeviceEvent,
    DeviceEventKind,
    DeviceListener,
    PluginConnection,
    PluginConnector,
    PluginDialError,
    RegistrationError,
)
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.core.checkpoint import CheckpointData
from deviceplane.core.constants import DIAL_TIMEOUT_SECONDS
from deviceplane.core.registry import AlreadyConnectedError, Device, DeviceRegistry, SnapshotResult

log = logging.getLogger("deviceplane.agent.plugins.manager")

EXPIRE_INTERVAL_SECONDS = 1.0

ClientKey = tuple[str, str]  # (resource, socket path)


class DeviceManager:
    """Plugin connections (through `connector`) feeding the registry; every change requests a checkpoint write and
    is told to `listeners`. Implements `PluginHandler` for the transport and `PluginLookup` for admission."""

    def __init__(
        self,
        registry: DeviceRegistry,
        checkpoint: CheckpointWriter,
        connector: PluginConnector,
        listeners: Sequence[DeviceListener] = (),
        dial_timeout: float = DIAL_TIMEOUT_SECONDS,
        count_snapshot: Callable[[str, bool], None] = lambda _resource, _changed: None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._checkpoint = checkpoint
        self._connector = connector
        self._listeners = tuple(listeners)
        self._dial_timeout = dial_timeout
        self._count_snapshot = count_snapshot  # every applied ListAndWatch message: (resource, changed anything)
        self._clock = clock  # grace periods and ordering
        self._wall_clock = wall_clock  # registration times as shown
        self._clients: dict[ClientKey, PluginConnection] = {}
        self._connecting: set[ClientKey] = set()

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def restore(self, data: CheckpointData | None) -> None:
        """At start, from the checkpoint: its resources come back stopped, reporting 0/0 until their plugins return."""
        if data is not None and data.RegisteredDevices:
            self._registry.restore(data.RegisteredDevices, self._clock())

    async def stop(self) -> None:
        """Disconnect every plugin (their resources turn unhealthy, as upstream Stop) and flush the checkpoint."""
        for (resource, socket_path), client in list(self._clients.items()):
            await client.close()
            self._clients.pop((resource, socket_path), None)
            self._registry.plugin_disconnected(resource, socket_path, self._clock())
        self._checkpoint.request()
        await self._checkpoint.close()

    # -- registration -----------------------------------------------------------------------------------------------

    async def register(self, resource: str, socket_path: str) -> None:
        """Connect to a plugin that registered (kubelet connectClient + PluginConnected, spec §4.2 step 4-5)."""
        key = (resource, socket_path)
        if key in self._connecting:
            raise RegistrationError(f"device plugin already connecting for resource {resource} at socket {socket_path}")
        self._connecting.add(key)
        client = self._connector(resource, socket_path)
        try:
            try:
                options = await client.connect(self._dial_timeout)
            except PluginDialError as err:
                raise RegistrationError(str(err)) from err
            old = self._clients.pop(key, None)
            if old is not None:
                await old.close()
                self._registry.plugin_reconnected(resource, socket_path, options, self._clock(), self._wall_clock())
            else:
                try:
                    self._registry.plugin_connected(resource, socket_path, options, self._clock(), self._wall_clock())
                except AlreadyConnectedError as err:  # defensive: registry and clients disagree
                    raise RegistrationError(str(err)) from err
            self._clients[key] = client
        except BaseException:
            await client.close()
            raise
        finally:
            self._connecting.discard(key)
        client.start_stream(
            lambda devices: self._on_snapshot(resource, socket_path, client, devices),
            lambda reason: self._on_stream_end(resource, socket_path, client, reason),
        )
        log.info("device plugin registered", extra={"resource": resource, "endpoint": socket_path})
        self._notify(DeviceEvent(resource, DeviceEventKind.CONNECTED))
        # One loop pass before Register answers, so the ListAndWatch request start_stream created is handed to gRPC
        # first: the kubelet races its ListAndWatch goroutine against the answer, it never waits for either.
        await asyncio.sleep(0)

    async def deregister(self, resource: str, socket_path: str, reason: str) -> bool:
        client = self._clients.pop((resource, socket_path), None)
        if client is None:
            return False
        await client.close()
        self._disconnected(resource, socket_path, reason)
        return True

    def client(self, resource: str) -> PluginConnection | None:
        """The primary plugin connection of a resource, if it is connected."""
        endpoint = self._registry.primary_endpoint(resource)
        if endpoint is None or endpoint.socket_path is None or endpoint.is_stopped:
            return None
        return self._clients.get((resource, endpoint.socket_path))

    # -- stream callbacks -------------------------------------------------------------------------------------------

    def _on_snapshot(
        self, resource: str, socket_path: str, client: PluginConnection, devices: Sequence[Device]
    ) -> None:
        if self._clients.get((resource, socket_path)) is not client:
            return  # a replaced connection's late message
        result: SnapshotResult = self._registry.apply_snapshot(resource, socket_path, devices)
        if result.applied:
            self._count_snapshot(resource, result.changed)
        if result.changed:  # an identical resend is nobody's news (upstream rewrites its checkpoint for it)
            self._checkpoint.request()
            self._notify(DeviceEvent(resource, DeviceEventKind.SNAPSHOT, result.transitions))

    async def _on_stream_end(self, resource: str, socket_path: str, client: PluginConnection, reason: str) -> None:
        # Only the connection that is still current may disconnect: a stale stream ending never touches a newer
        # plugin on the same socket (kubernetes#121994).
        if self._clients.get((resource, socket_path)) is not client:
            return
        del self._clients[(resource, socket_path)]
        await client.close()
        self._disconnected(resource, socket_path, reason)

    def _disconnected(self, resource: str, socket_path: str, reason: str) -> None:
        if self._registry.plugin_disconnected(resource, socket_path, self._clock()):
            log.warning(
                "device plugin disconnected", extra={"resource": resource, "endpoint": socket_path, "reason": reason}
            )
            self._checkpoint.request()
            self._notify(DeviceEvent(resource, DeviceEventKind.DISCONNECTED))

    # -- grace period -----------------------------------------------------------------------------------------------

    def expire(self) -> tuple[str, ...]:
        """Delete the resources whose plugin is gone for longer than the grace period (and rewrite the checkpoint).
        Called on a timer (`expire_loop`), never by a read."""
        deleted = self._registry.expire(self._clock())
        if deleted:
            self._checkpoint.request()
            for resource in deleted:
                log.info("resource deleted after grace period", extra={"resource": resource})
                self._notify(DeviceEvent(resource, DeviceEventKind.DELETED))
        return deleted

    async def expire_loop(self, interval: float = EXPIRE_INTERVAL_SECONDS) -> None:
        while True:
            await asyncio.sleep(interval)
            self.expire()

    def _notify(self, event: DeviceEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("device event listener failed")
