"""Everything proxy mode adds to the agent, built in one constructor (the composition root wires it in a few lines):
the connector the device manager makes its plugin connections with, the proxy endpoints, the plugin record used at
restart, and the counting of forwarded Allocate calls."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Protocol

import grpc

from deviceplane.agent.in_flight import InFlight
from deviceplane.agent.plugins.contracts import DeviceEvent
from deviceplane.agent.proxy.forwarder import ForwardedCall
from deviceplane.agent.proxy.metrics import ProxyCollector
from deviceplane.agent.proxy.ownership import Ownership
from deviceplane.agent.proxy.recovery import PluginRecord, reconnect, remove_stale_sockets
from deviceplane.agent.proxy.service import ProxyConnector, ProxyService
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.tasks import TaskFactory
from deviceplane.core.allocator import AllocationResult
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.agent.proxy")

# A forwarded Allocate's status as the agent's allocation result label (the same label set as in agent mode).
_RESULTS = {
    grpc.StatusCode.OK: AllocationResult.SUCCESS,
    grpc.StatusCode.DEADLINE_EXCEEDED: AllocationResult.TIMEOUT,
}


class Register(Protocol):
    """The device manager's registration (DeviceManager.register)."""

    def __call__(self, resource: str, socket_path: str, *, provisional: bool = False) -> Awaitable[None]: ...


class ProxyMode:
    def __init__(
        self,
        registry: DeviceRegistry,
        plugin_dir: Path,
        kubelet_dir: Path,
        ownership: Ownership,
        metrics: AgentMetrics,
    ) -> None:
        self._plugin_dir = plugin_dir
        self._ownership = ownership
        self._metrics = metrics
        self._record = PluginRecord(plugin_dir)
        # The device manager makes its plugin connections with this connector.
        self.connector = ProxyConnector()
        self._in_flight = InFlight()  # forwarded calls
        self._service = ProxyService(registry, self.connector, kubelet_dir, self._on_call, self._in_flight)
        metrics.prometheus.register(
            ProxyCollector(
                metrics.node,
                ownership,
                lambda: [state.name for state in registry.statuses()],
                self._service.kubelet_registered,
            )
        )

    def kubelet_registered(self, resource: str) -> bool | None:
        """Whether the resource's proxy endpoint is registered with the kubelet now (None: it has no endpoint)."""
        return self._service.kubelet_registered(resource)

    @property
    def registrations_generation(self) -> int:
        """Changes when an endpoint's registration with the kubelet does."""
        return self._service.registrations_generation

    def on_device_event(self, event: DeviceEvent) -> None:
        """Device listener: the kubelet's feed follows at once, and the plugin record is kept current."""
        self._service.on_device_event(event)
        self._record.save(self._service.connected_plugins())

    async def recover(self, register: Register) -> list[str]:
        """At start, instead of removing every socket: keep and re-dial the recorded plugins (the other stale
        sockets, and stale proxy endpoints, are removed). Returns the removed socket names.

        The connections are provisional: a recorded socket may serve another resource by now, and a plugin that
        registers it for another resource ends the recovered one."""
        recorded = self._record.load()
        removed = remove_stale_sockets(self._plugin_dir, keep=set(recorded.values()))
        removed += self._service.remove_stale_endpoints()

        async def register_provisionally(resource: str, socket_path: str) -> None:
            await register(resource, socket_path, provisional=True)

        back = await reconnect(recorded, register_provisionally)
        if recorded:
            log.info("reconnected recorded plugins", extra={"resources": back, "recorded": sorted(recorded)})
        return removed

    def quiet_for(self) -> float:
        """Seconds since the last call from the kubelet was forwarded; 0 while one is."""
        return self._in_flight.quiet_for()

    def tasks(self) -> list[tuple[str, TaskFactory]]:
        return [("proxy-endpoints", self._service.run), ("proxy-ownership", self._ownership.run)]

    async def stop(self) -> None:
        """Close the proxy endpoints (after the tasks stopped): the kubelet sees their streams end at once."""
        await self._service.close()

    def _on_call(self, call: ForwardedCall) -> None:
        if call.method != "Allocate":
            return
        if not call.reached_plugin:
            result = AllocationResult.NO_ENDPOINT
        else:
            result = _RESULTS.get(call.code, AllocationResult.RPC_ERROR)
        if result is AllocationResult.SUCCESS:
            self._ownership.allocated(call.resource, call.request)
        self._metrics.observe_allocate(call.resource, call.seconds)
        self._metrics.count_allocation(call.resource, result)
