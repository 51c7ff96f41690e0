"""Proxy mode's moving parts behind one start/stop: a proxy endpoint per resource whose plugin ever connected,
kept registered with the kubelet across restarts on every side, and the kubelet's ownership view.

- Kubelet restart: it deletes every socket in its directory and re-creates `kubelet.sock`. A tick notices (both the
  proxy socket and kubelet.sock have new identities), serves the socket again and registers every resource whose
  plugin is connected (the others once their plugin is back, as with direct registration).
- Plugin restart: the plugin re-registers with the agent; its new connection becomes the resource's primary and
  its first message replaces the old one in the feed. The kubelet's stream never ends, so it never disconnects.
  When the new plugin's options differ (e.g. it now needs PreStartContainer), the kubelet's stream ends and the
  endpoint is registered again: the kubelet asks a plugin's options only when it registers; its devices wait for it.
- The kubelet drops an endpoint (it refused a message): registered again, as a plugin registered directly would.
- Agent restart: stale proxy sockets are removed; plugins re-register (the agent re-created its kubelet.sock), and
  each resource is proxied and registered again. The kubelet's checkpoint keeps what it allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from deviceplane.agent.in_flight import InFlight
from deviceplane.agent.plugins.contracts import DeviceEvent
from deviceplane.agent.plugins.plugin_client import PluginClient
from deviceplane.agent.proxy.endpoint import ProxyEndpoint, remove_stale_endpoints
from deviceplane.agent.proxy.feed import SnapshotFeed
from deviceplane.agent.proxy.forwarder import ForwardedCall, ResourceForwarder
from deviceplane.aio import cancel_and_wait
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.constants import KUBELET_SOCKET_NAME
from deviceplane.core.registry import DeviceRegistry, PluginOptions
from deviceplane.core.snapshot import AS_SENT
from deviceplane.unix_sockets import SocketIdentity, kubelet_socket_identity

log = logging.getLogger("deviceplane.agent.proxy")

TICK_SECONDS = 0.1  # how fast a kubelet restart is noticed (re-registration within 1 s)
REGISTER_TIMEOUT_SECONDS = 10.0
REGISTER_RETRY_SECONDS = 0.5
# Between ending the kubelet's streams of an endpoint and registering it again with other options: the kubelet drops
# its client when the stream ends (in a goroutine of its own, at once); a registration before that would be the client
# it drops (kubernetes#121994).
CLIENT_DROP_SECONDS = 1.0
# A kubelet that keeps dropping an endpoint (it refuses every message) is registered with again after twice the pause
# each time, up to this; a drop this long after the previous one starts from CLIENT_DROP_SECONDS again.
MAX_DROP_PAUSE_SECONDS = 30.0
DROPS_FORGOTTEN_AFTER_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Drop:
    """The kubelet (its socket's identity) ended its last stream of an endpoint, the count-th time in a row, at `at`:
    no registration with that kubelet before `pause_until`."""

    kubelet: SocketIdentity
    count: int
    at: float
    pause_until: float


class ProxyConnector:
    """Makes the device manager's plugin connections (a `PluginConnector`), so it knows each one: the latest raw
    ListAndWatch message of each, and which is current for a (resource, socket) - the newest not closed, since the
    manager closes a connection as soon as it is replaced, fails to connect, or its stream ends."""

    def __init__(self) -> None:
        self._latest: weakref.WeakKeyDictionary[PluginClient, pb.ListAndWatchResponse] = weakref.WeakKeyDictionary()
        self._made: dict[tuple[str, str], list[weakref.ref[PluginClient]]] = {}

    def __call__(self, resource: str, socket_path: str) -> PluginClient:
        ref: list[weakref.ref[PluginClient]] = []

        def record(message: pb.ListAndWatchResponse) -> None:
            client = ref[0]()
            if client is not None:
                self._latest[client] = message

        # The kubelet gets every message unchanged, so the agent's view takes it as sent too: both count it alike.
        client = PluginClient(resource, socket_path, on_message=record, rules=AS_SENT)
        ref.append(weakref.ref(client))
        self._forget_closed()
        self._made.setdefault((resource, socket_path), []).append(ref[0])
        return client

    def _forget_closed(self) -> None:
        """Drop closed and collected connections, and the sockets left with none: a plugin that restarts under a new
        socket name each time (its pid in the name) would otherwise leave an entry per restart."""
        for key, made in list(self._made.items()):
            made[:] = [r for r in made if (c := r()) is not None and not c.closed]
            if not made:
                del self._made[key]

    def current(self, resource: str, socket_path: str) -> PluginClient | None:
        for ref in reversed(self._made.get((resource, socket_path), [])):
            client = ref()
            if client is not None and not client.closed:
                return client
        return None

    def latest(self, client: PluginClient | None) -> pb.ListAndWatchResponse | None:
        return self._latest.get(client) if client is not None else None


class ProxyService:
    def __init__(
        self,
        registry: DeviceRegistry,
        connector: ProxyConnector,
        kubelet_dir: Path,
        on_call: Callable[[ForwardedCall], None],
        in_flight: InFlight,
        register_timeout: float = REGISTER_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._connector = connector
        self._kubelet_dir = kubelet_dir
        self._kubelet_socket = kubelet_dir / KUBELET_SOCKET_NAME
        self._on_call = on_call
        self._in_flight = in_flight
        self._register_timeout = register_timeout
        self._clock = clock
        self._feeds: dict[str, SnapshotFeed] = {}
        self._endpoints: dict[str, ProxyEndpoint] = {}
        self._retry_at: dict[str, float] = {}
        self._registering: dict[str, asyncio.Task[None]] = {}  # at most one registration in flight per resource
        self._errors: dict[str, tuple[str, str]] = {}  # the last failure logged per resource
        self._drops: dict[str, Drop] = {}  # the last time the kubelet dropped an endpoint
        self._registered_seen: frozenset[str] = frozenset()
        # Bumped when the set of endpoints registered with the kubelet changes (seen each tick), so that a NodeDevices
        # publisher knows to write again.
        self.registrations_generation = 0

    # -- what the kubelet sees ----------------------------------------------------------------------------------------

    def plugin(self, resource: str) -> PluginClient | None:
        """The resource's primary plugin connection, while it is connected."""
        endpoint = self._registry.primary_endpoint(resource)
        if endpoint is None or endpoint.socket_path is None or endpoint.is_stopped:
            return None
        return self._connector.current(resource, endpoint.socket_path)

    def options(self, resource: str) -> PluginOptions | None:
        endpoint = self._registry.primary_endpoint(resource)
        return endpoint.options if endpoint is not None else None

    def on_device_event(self, event: DeviceEvent) -> None:
        """Device listener: after any change of a resource, its feed shows the new state at once."""
        self._show(event.resource)

    def _show(self, resource: str) -> None:
        feed = self._feeds.get(resource)
        state = self._registry.resource(resource)
        if feed is not None and state is not None:
            feed.show(self._connector.latest(self.plugin(resource)), state.connected and self._told(resource))

    def _told(self, resource: str) -> bool:
        """Whether the kubelet knows the primary plugin's options. It learns them only when the endpoint registers:
        a plugin replaced by one with other options (now needing PreStartContainer) stays shown as disconnected (its
        devices unhealthy) until the endpoint is registered again, so no pod is admitted under the old options."""
        endpoint = self._endpoints.get(resource)
        told = endpoint.told_options if endpoint is not None else None
        return told is None or told == (self.options(resource) or PluginOptions())

    def kubelet_registered(self, resource: str) -> bool | None:
        """Whether the resource's endpoint is registered with the kubelet serving kubelet.sock now; None for a
        resource without an endpoint (no plugin ever connected for it). False while the kubelet restarts, after it
        dropped the endpoint, and while new options wait to be registered."""
        endpoint = self._endpoints.get(resource)
        if endpoint is None:
            return None
        kubelet = kubelet_socket_identity(self._kubelet_socket)
        return endpoint.serving and kubelet is not None and endpoint.registered_with_kubelet(kubelet)

    def _note_registrations(self) -> None:
        registered = frozenset(name for name in self._endpoints if self.kubelet_registered(name))
        if registered != self._registered_seen:
            self._registered_seen = registered
            self.registrations_generation += 1

    def connected_plugins(self) -> dict[str, str]:
        """Resource -> socket of its connected primary plugin (what an agent restart reconnects to)."""
        return {
            state.name: state.primary.socket_path
            for state in self._registry.statuses()
            if state.connected and state.primary is not None and state.primary.socket_path is not None
        }

    def _wanted(self) -> list[str]:
        """Resources a plugin connected for (not a checkpoint's placeholder) and not yet deleted."""
        return [
            state.name
            for state in self._registry.statuses()
            if state.primary is not None and state.primary.socket_path is not None
        ]

    # -- lifecycle ----------------------------------------------------------------------------------------------------

    def remove_stale_endpoints(self) -> list[str]:
        """A previous agent's proxy sockets in the kubelet's directory (after SIGKILL nobody removed them)."""
        return remove_stale_endpoints(self._kubelet_dir)

    async def close(self) -> None:
        for name in list(self._endpoints):
            await self._drop(name)

    async def run(self) -> None:
        """Runs until cancelled: keeps every wanted endpoint served and registered with the kubelet. The
        registrations it starts end with it (a supervisor's restart starts them again)."""
        try:
            while True:
                try:
                    await self.reconcile()
                    self._note_registrations()
                except Exception:  # one bad tick must not end proxying
                    log.exception("proxy reconcile failed")
                await asyncio.sleep(TICK_SECONDS)
        finally:
            await cancel_and_wait(self._registering.values())

    async def reconcile(self) -> None:
        wanted = self._wanted()
        for name in [n for n in self._endpoints if n not in wanted]:
            await self._drop(name)
        for name in wanted:
            endpoint = self._endpoints.get(name)
            if endpoint is None:
                endpoint = self._add(name)
            if self._clock() < self._retry_at.get(name, 0.0):
                continue
            try:
                if await endpoint.ensure_serving():
                    log.info("proxy endpoint serving", extra={"resource": name, "socket": str(endpoint.socket_path)})
            except (OSError, RuntimeError) as err:  # e.g. the kubelet's directory is not writable: others go on
                self._failed(name, "cannot serve the proxy endpoint", str(err))
                continue
            self._show(name)
        kubelet = kubelet_socket_identity(self._kubelet_socket)
        if kubelet is None:
            return  # the kubelet is not (yet) serving; its socket's appearance triggers registration
        for name, endpoint in self._endpoints.items():
            options = self.options(name) or PluginOptions()
            if self._registration_due(name, endpoint, kubelet, options) and not self._ending_old_client(name, options):
                self._start_registration(name, endpoint, kubelet, options)

    def _registration_due(
        self, name: str, endpoint: ProxyEndpoint, kubelet: SocketIdentity, options: PluginOptions
    ) -> bool:
        """Served, not registered with this kubelet.sock and these options, none in flight, not waiting to retry, and
        its plugin connected: a kubelet that restarted while the plugin is away knows the resource from its checkpoint
        (no devices, deleted after its grace period) until the plugin is back, as when the plugin registers with it
        directly."""
        state = self._registry.resource(name)
        drop = self._drops.get(name)
        return (
            state is not None
            and state.connected
            and (drop is None or drop.kubelet != kubelet or self._clock() >= drop.pause_until)
            and endpoint.serving
            and name not in self._registering
            and not endpoint.registered_with(kubelet, options)
            and self._clock() >= self._retry_at.get(name, 0.0)
        )

    def _ending_old_client(self, name: str, options: PluginOptions) -> bool:
        """Before the endpoint registers again with other options, the kubelet's client for it ends, as when a plugin
        it knew directly goes away: the kubelet replaces a client without closing it and reads its stream for as long
        as it stays open (one more connection and stream, and one more update of every device, per re-registration),
        and a stream of a replaced client that ends disconnects the newer one (kubernetes#121994). True while the
        registration must wait for that."""
        endpoint = self._endpoints[name]
        told = endpoint.told_options
        if told is None or told == options or endpoint.withdrawn:
            return False
        self._feeds[name].end_streams()
        endpoint.withdraw()
        self._retry_at[name] = self._clock() + CLIENT_DROP_SECONDS
        log.info("ending the kubelet's client before registering new options", extra={"resource": name})
        return True

    def _kubelet_dropped(self, name: str) -> None:
        """The kubelet ended its last stream of the endpoint itself (it refused a message, say) and so disconnected
        the resource; it never dials back. A plugin it knew directly would register again (deviceplane's SDK does):
        so does the endpoint, after the kubelet dropped its client, with a growing pause while the kubelet keeps
        dropping it. A kubelet that went away (its socket gone or replaced) needs nothing: its successor is
        registered with anyway."""
        endpoint = self._endpoints.get(name)
        kubelet = kubelet_socket_identity(self._kubelet_socket)
        if endpoint is None or kubelet is None or not endpoint.registered_with_kubelet(kubelet):
            return
        now = self._clock()
        previous = self._drops.get(name)
        count = previous.count + 1 if previous is not None and now - previous.at < DROPS_FORGOTTEN_AFTER_SECONDS else 1
        pause = min(CLIENT_DROP_SECONDS * 2 ** (count - 1), MAX_DROP_PAUSE_SECONDS)
        self._drops[name] = Drop(kubelet, count, now, now + pause)
        endpoint.withdraw()
        log.warning("the kubelet dropped the proxy endpoint; registering again", extra={"resource": name})

    def _start_registration(
        self, name: str, endpoint: ProxyEndpoint, kubelet: SocketIdentity, options: PluginOptions
    ) -> None:
        """In a task of its own: a tick never waits for the kubelet, so a registration that hangs (the kubelet asks
        the plugin's options without a deadline) holds up no other resource."""
        task = asyncio.create_task(self._register(name, endpoint, kubelet, options), name=f"proxy-register {name}")
        self._registering[name] = task
        task.add_done_callback(functools.partial(self._registration_ended, name))

    def _registration_ended(self, name: str, task: asyncio.Task[None]) -> None:
        if self._registering.get(name) is task:
            del self._registering[name]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:  # the kubelet's errors are handled in _register: this is a bug, seen and retried
            log.error("registration with the kubelet crashed", extra={"resource": name}, exc_info=error)
            self._failed(name, "registration with the kubelet crashed", repr(error))

    async def _register(
        self, name: str, endpoint: ProxyEndpoint, kubelet: SocketIdentity, options: PluginOptions
    ) -> None:
        try:
            await endpoint.register(self._kubelet_socket, kubelet, options, self._register_timeout)
        except grpc.aio.AioRpcError as err:
            self._failed(name, "registration with the kubelet failed", f"{err.code().name}: {err.details()}")
            return
        self._errors.pop(name, None)
        log.info("registered with the kubelet", extra={"resource": name, "endpoint": endpoint.name, "options": options})
        self._show(name)  # the kubelet knows the options now: the plugin's devices, if they waited for that

    def _failed(self, name: str, what: str, error: str) -> None:
        """Retry later; log once per distinct failure (a missing kubelet must not flood the log every tick)."""
        self._retry_at[name] = self._clock() + REGISTER_RETRY_SECONDS
        if self._errors.get(name) != (what, error):
            self._errors[name] = (what, error)
            log.warning(what, extra={"resource": name, "error": error})

    def _add(self, name: str) -> ProxyEndpoint:
        feed = self._feeds[name] = SnapshotFeed()
        forwarder = ResourceForwarder(
            name, feed, self.plugin, self.options, self._on_call, self._in_flight, self._kubelet_dropped
        )
        endpoint = self._endpoints[name] = ProxyEndpoint(name, self._kubelet_dir, forwarder.handler())
        return endpoint

    async def _drop(self, name: str) -> None:
        feed = self._feeds.pop(name, None)
        if feed is not None:
            feed.close()
        endpoint = self._endpoints.pop(name, None)
        registering = self._registering.pop(name, None)
        if registering is not None:
            await cancel_and_wait([registering])
        self._retry_at.pop(name, None)
        self._errors.pop(name, None)
        self._drops.pop(name, None)
        if endpoint is not None:
            with contextlib.suppress(Exception):
                await endpoint.close()
            log.info("proxy endpoint removed", extra={"resource": name})
