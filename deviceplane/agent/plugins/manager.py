"""The device manager: core bookkeeping driven by real plugin connections, persisted to the kubelet checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deviceplane.agent.plugins.plugin_client import PluginClient, PluginDialError
from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.core.checkpoint import CheckpointData, PodDevicesEntry
from deviceplane.core.constants import DIAL_TIMEOUT_SECONDS
from deviceplane.core.registry import AlreadyConnectedError, Capacity, Device, DeviceRegistry, SnapshotResult

log = logging.getLogger("deviceplane.agent.plugins.manager")

ClientKey = tuple[str, str]  # (resource, socket path)


class RegistrationError(Exception):
    """A registration the manager refused; the message is what the plugin is told."""


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """What observers (metrics, publishers) hear after each change."""

    resource: str
    kind: str  # "connected" | "disconnected" | "snapshot" | "deleted"
    transitions: tuple[str, ...] = ()


class DeviceManager:
    def __init__(
        self,
        store: CheckpointStore,
        grace_period: float,
        dial_timeout: float = DIAL_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.time,
        connector: Callable[[str, str], PluginClient] = PluginClient,
    ) -> None:
        self.registry = DeviceRegistry(grace_period)
        self._connector = connector
        self.dial_timeout = dial_timeout
        self.clock = clock
        self._store = store
        self._clients: dict[ClientKey, PluginClient] = {}
        self._connecting: set[ClientKey] = set()
        self.checkpoint = CheckpointWriter(store.write, self._checkpoint_data)
        self.observers: list[Callable[[DeviceEvent], None]] = []
        # The allocations to checkpoint (set by the admission controller); a cheap list copy, taken on the loop.
        self.pod_entries: Callable[[], list[PodDevicesEntry]] = list

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def restore(self) -> CheckpointData | None:
        """Read the checkpoint at start: its resources come back stopped, reporting 0/0 until their plugins return."""
        data = self._store.read()
        if data is not None and data.RegisteredDevices:
            self.registry.restore(data.RegisteredDevices, self.clock())
        return data

    async def stop(self) -> None:
        """Disconnect every plugin (their resources turn unhealthy, as upstream Stop) and flush the checkpoint."""
        for (resource, socket_path), client in list(self._clients.items()):
            await client.close()
            self._clients.pop((resource, socket_path), None)
            self.registry.plugin_disconnected(resource, socket_path, self.clock())
        self.checkpoint.request()
        await self.checkpoint.close()

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
                options = await client.connect(self.dial_timeout)
            except PluginDialError as err:
                raise RegistrationError(str(err)) from err
            old = self._clients.pop(key, None)
            if old is not None:
                await old.close()
                self.registry.plugin_reconnected(resource, socket_path, options, self.clock())
            else:
                try:
                    self.registry.plugin_connected(resource, socket_path, options, self.clock())
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
        self._notify(DeviceEvent(resource, "connected"))

    async def deregister(self, resource: str, socket_path: str, reason: str = "deregistered") -> bool:
        client = self._clients.pop((resource, socket_path), None)
        if client is None:
            return False
        await client.close()
        self._disconnected(resource, socket_path, reason)
        return True

    def client(self, resource: str) -> PluginClient | None:
        """The primary plugin connection of a resource, if it is connected."""
        endpoint = self.registry.primary_endpoint(resource)
        if endpoint is None or endpoint.socket_path is None or endpoint.is_stopped:
            return None
        return self._clients.get((resource, endpoint.socket_path))

    # -- stream callbacks -------------------------------------------------------------------------------------------

    def _on_snapshot(self, resource: str, socket_path: str, client: PluginClient, devices: Sequence[Device]) -> None:
        if self._clients.get((resource, socket_path)) is not client:
            return  # a replaced connection's late message
        result: SnapshotResult = self.registry.apply_snapshot(resource, socket_path, devices)
        if result.applied:
            self.checkpoint.request()
            self._notify(DeviceEvent(resource, "snapshot", result.transitions))

    async def _on_stream_end(self, resource: str, socket_path: str, client: PluginClient, reason: str) -> None:
        # Only the connection that is still current may disconnect: a stale stream ending never touches a newer
        # plugin on the same socket (kubernetes#121994).
        if self._clients.get((resource, socket_path)) is not client:
            return
        del self._clients[(resource, socket_path)]
        await client.close()
        self._disconnected(resource, socket_path, reason)

    def _disconnected(self, resource: str, socket_path: str, reason: str) -> None:
        if self.registry.plugin_disconnected(resource, socket_path, self.clock()):
            log.warning(
                "device plugin disconnected", extra={"resource": resource, "endpoint": socket_path, "reason": reason}
            )
            self.checkpoint.request()
            self._notify(DeviceEvent(resource, "disconnected"))

    # -- views ------------------------------------------------------------------------------------------------------

    def sweep(self) -> Capacity:
        """Capacity now; resources past their grace period are deleted (and the checkpoint rewritten)."""
        result = self.registry.sweep(self.clock())
        if result.deleted:
            self.checkpoint.request()
            for resource in result.deleted:
                log.info("resource deleted after grace period", extra={"resource": resource})
                self._notify(DeviceEvent(resource, "deleted"))
        return result

    def _checkpoint_data(self) -> CheckpointData:
        # PodDeviceEntries stays nil (null) while nothing is allocated, exactly as the kubelet writes it.
        entries = self.pod_entries()
        return CheckpointData(PodDeviceEntries=entries or None, RegisteredDevices=self.registry.registered_healthy())

    def _notify(self, event: DeviceEvent) -> None:
        for observer in self.observers:
            try:
                observer(event)
            except Exception:
                log.exception("device event observer failed")
