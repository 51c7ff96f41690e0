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
from deviceplane.aio import cancel_and_wait
from deviceplane.core.checkpoint import CheckpointData
from deviceplane.core.constants import DIAL_TIMEOUT_SECONDS
from deviceplane.core.registry import AlreadyConnectedError, Device, DeviceRegistry, SnapshotResult

log = logging.getLogger("deviceplane.agent.plugins.manager")

EXPIRE_INTERVAL_SECONDS = 1.0
# How long a connection replaced by its plugin's re-registration on the same socket stays open for the calls still in
# flight on it: the kubelet never cancels them on re-registration, so neither do we; bounded, so a call that never ends
# cannot keep the old connection open forever. 30 s is the longest deadline the kubelet gives a plugin call
# (PreStartContainer; it sets none for Allocate).
REPLACED_CONNECTION_DRAIN_SECONDS = 30.0

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
        self._provisional: set[ClientKey] = set()  # connections made without the plugin's registration
        self._draining: set[asyncio.Task[None]] = set()  # replaced connections closing after their calls in flight

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def restore(self, data: CheckpointData | None) -> None:
        """At start, from the checkpoint: its resources come back stopped, reporting 0/0 until their plugins return."""
        if data is not None and data.RegisteredDevices:
            self._registry.restore(data.RegisteredDevices, self._clock())

    async def stop(self) -> None:
        """Disconnect every plugin (their resources turn unhealthy, as upstream Stop) and flush the checkpoint."""
        await cancel_and_wait(self._draining)  # replaced connections close now, their calls in flight fail
        for (resource, socket_path), client in list(self._clients.items()):
            await client.close()
            self._clients.pop((resource, socket_path), None)
            self._registry.plugin_disconnected(resource, socket_path, self._clock())
        self._checkpoint.request()
        await self._checkpoint.close()

    # -- registration -----------------------------------------------------------------------------------------------

    async def register(self, resource: str, socket_path: str, *, provisional: bool = False) -> None:
        """Connect to a plugin that registered (kubelet connectClient + PluginConnected, spec §4.2 step 4-5).

        `provisional`: the agent connects on its own, to the socket a plugin had before the agent restarted (proxy
        mode's recovery). That socket may serve another resource by now, which a plugin's stream cannot tell: when a
        plugin registers the socket for another resource, the provisional connection is dropped."""
        key = (resource, socket_path)
        if not provisional:
            await self._drop_provisional(socket_path, keep=resource)
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
                self._drain(old)
                self._registry.plugin_reconnected(resource, socket_path, options, self._clock(), self._wall_clock())
            else:
                try:
                    self._registry.plugin_connected(resource, socket_path, options, self._clock(), self._wall_clock())
                except AlreadyConnectedError as err:  # defensive: registry and clients disagree
                    raise RegistrationError(str(err)) from err
            self._clients[key] = client
            if provisional:
                self._provisional.add(key)
            else:
                self._provisional.discard(key)  # confirmed by the plugin's own registration
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

    def _drain(self, old: PluginConnection) -> None:
        """A connection its plugin replaced by registering again on the same socket: its stream stops at once (the
        new connection's stream is the one that counts), its calls in flight finish, then it closes."""
        closing = old.close_after_calls(REPLACED_CONNECTION_DRAIN_SECONDS)
        task = asyncio.create_task(closing, name="drain a replaced plugin connection")
        self._draining.add(task)
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        self._draining.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("closing a replaced plugin connection failed", exc_info=task.exception())

    async def _drop_provisional(self, socket_path: str, keep: str) -> None:
        """A plugin registered `socket_path` for `keep`: a provisional connection to it for another resource is
        wrong, and disconnected as if its plugin went away."""
        for resource, path in [k for k in self._provisional if k[1] == socket_path and k[0] != keep]:
            self._provisional.discard((resource, path))
            await self.deregister(resource, path, f"its socket now serves {keep}")

    async def deregister(self, resource: str, socket_path: str, reason: str) -> bool:
        self._provisional.discard((resource, socket_path))
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
        self._provisional.discard((resource, socket_path))
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
