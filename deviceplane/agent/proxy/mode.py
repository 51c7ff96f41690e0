"""Everything proxy mode adds to the agent, behind one start/stop (the composition root wires it in a few lines)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from deviceplane.agent.proxy.forwarder import ForwardedCall
from deviceplane.agent.proxy.ownership import Ownership
from deviceplane.agent.proxy.recovery import PluginRecord, reconnect, remove_stale_sockets
from deviceplane.agent.proxy.service import ProxyConnector, ProxyService
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.api.models import AllocatedTo
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.agent.proxy")


class ProxyMode:
    def __init__(self, plugin_dir: Path, kubelet_dir: Path, kubelet_pod_resources_socket: Path) -> None:
        self.plugin_dir = plugin_dir
        self.kubelet_dir = kubelet_dir
        self.connector = ProxyConnector()
        self.record = PluginRecord(plugin_dir)
        self.ownership = Ownership(kubelet_pod_resources_socket)
        self._service: ProxyService | None = None
        self._metrics: AgentMetrics | None = None
        self._ownership_task: asyncio.Task[None] | None = None

    def bind(self, registry: DeviceRegistry, plugin_lookup: Callable[[str], object | None]) -> None:
        self._service = ProxyService(registry, plugin_lookup, self.connector, self.kubelet_dir, self._on_call)

    def on_device_event(self, event: object) -> None:
        """Device manager listener: the kubelet's feed follows at once, and the plugin record is kept current."""
        if self._service is not None:
            self._service.on_device_event(event)
            self.record.save(self._service.connected_plugins())

    async def recover(self, register: Callable[[str, str], Awaitable[None]]) -> list[str]:
        """At start, instead of removing every socket: keep and re-dial the recorded plugins; the stale sockets
        removed."""
        recorded = self.record.load()
        removed = remove_stale_sockets(self.plugin_dir, keep=set(recorded.values()))
        back = await reconnect(recorded, register)
        if recorded:
            log.info("reconnected recorded plugins", extra={"resources": back, "recorded": sorted(recorded)})
        return removed

    def attach_metrics(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def _on_call(self, call: ForwardedCall) -> None:
        if call.method != "Allocate":
            return
        ok = call.code == grpc.StatusCode.OK
        if ok:
            self.ownership.allocated(call.resource, call.request)
        if self._metrics is not None:
            self._metrics.alloc_duration.labels(call.resource).observe(call.seconds)
            self._metrics.allocations_total.labels(call.resource, "success" if ok else call.code.name.lower()).inc()

    async def start(self) -> None:
        assert self._service is not None, "bind() first"
        await self._service.start()
        self._ownership_task = asyncio.create_task(self.ownership.run(), name="proxy-ownership")

    async def stop(self) -> None:
        if self._ownership_task is not None:
            self._ownership_task.cancel()
            await asyncio.gather(self._ownership_task, return_exceptions=True)
            self._ownership_task = None
        if self._service is not None:
            await self._service.stop()

    # -- views --------------------------------------------------------------------------------------------------------

    def holders(self) -> dict[tuple[str, str], AllocatedTo]:
        return self.ownership.holders()

    def allocated(self, resource: str) -> int:
        return self.ownership.allocated_count(resource)

    def pods_json(self) -> list[dict[str, Any]]:
        return self.ownership.pods_json()
