"""The agent's composition root: every object of the agent is built here, in dependency order, and receives what it
uses through its constructor. Nothing is wired after construction.

Extension points (in `Agent.__init__`, each marked "extension point"):
- device listeners: objects told every `DeviceEvent` (metrics, admission's wake-up; a Node/NodeDevices publisher);
- pod sources: `PodSource`s feeding the admission runner (the static pod directory; an API-server watch);
- background tasks: named long-lived coroutines, run under the supervisor (agent/supervisor.py: restarted with
  backoff when they fail, counted, shown in /readyz) after the servers start, cancelled at stop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from deviceplane.agent.admission.admitter import (
    STARTUP_PLUGIN_WAIT_SECONDS,
    AdmissionParts,
    AdmissionSettings,
    Admitter,
    DeviceChanges,
)
from deviceplane.agent.admission.plugin_calls import ALLOCATE_TIMEOUT_SECONDS, PluginCalls
from deviceplane.agent.admission.pod_source import PodSource, StaticPodDirectory
from deviceplane.agent.admission.runner import AdmissionRunner
from deviceplane.agent.host import default_node_name, detect_numa_nodes
from deviceplane.agent.plugins.contracts import DeviceListener
from deviceplane.agent.plugins.manager import DeviceManager
from deviceplane.agent.plugins.plugin_client import PluginClient
from deviceplane.agent.plugins.plugin_watcher import PluginWatcher
from deviceplane.agent.plugins.registration import RegistrationServicer, cleanup_plugin_dir
from deviceplane.agent.plugins.registration_server import RegistrationServer
from deviceplane.agent.serving.api_views import ApiViews
from deviceplane.agent.serving.debug_faults import add_fault_route, debug_faults_enabled
from deviceplane.agent.serving.http_api import build_app, serve
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.serving.podresources import PodResourcesServicer, serve_pod_resources
from deviceplane.agent.serving.state_metrics import JournalCorruptionCollector
from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.durability import AllocationStore, CheckpointContent
from deviceplane.agent.state.journal import Journal
from deviceplane.agent.supervisor import Supervisor
from deviceplane.agent.tasks import TaskFactory
from deviceplane.core.allocator import Allocator
from deviceplane.core.constants import DIAL_TIMEOUT_SECONDS
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodTable
from deviceplane.core.registry import DeviceRegistry

__all__ = ["Agent", "AgentConfig", "default_node_name", "run_agent"]

log = logging.getLogger("deviceplane.agent")


@dataclass(frozen=True)
class AgentConfig:
    plugin_dir: Path
    pod_resources_socket: Path
    node_name: str
    grace_period: float
    http_addr: str
    plugins_registry_dir: Path | None = None
    pod_manifest_dir: Path | None = None
    topology_policy: str = "none"
    numa_nodes: int | None = None
    standalone: bool = True
    kubeconfig: Path | None = None
    dial_timeout: float = DIAL_TIMEOUT_SECONDS
    allocate_timeout: float = ALLOCATE_TIMEOUT_SECONDS
    startup_plugin_wait: float = STARTUP_PLUGIN_WAIT_SECONDS


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

        # -- state: what the agent knows --------------------------------------------------------------------------
        self.registry = DeviceRegistry(config.grace_period)
        self.pod_devices = PodDevices()
        self.pods = PodTable()
        self.metrics = AgentMetrics(self.registry, config.node_name, self.pod_devices.allocated_count)
        # Every long-lived task runs under it (the background list below, the plugin watcher).
        self.supervisor = Supervisor(self.metrics.prometheus)

        # -- durable state: the kubelet checkpoint and the allocation journal ---------------------------------------
        self._checkpoint_file = CheckpointStore(config.plugin_dir)
        content = CheckpointContent(self.registry, self.pod_devices)
        checkpoint = CheckpointWriter(self._checkpoint_file.write, content.snapshot)
        journal = Journal(config.plugin_dir)
        self.metrics.prometheus.register(JournalCorruptionCollector(lambda: journal.corrupt_records))
        self.allocation_store = AllocationStore(self.pod_devices, journal, content, checkpoint)

        # -- plugin side ------------------------------------------------------------------------------------------
        device_changes = DeviceChanges()
        # extension point: device listeners (a Node/NodeDevices publisher is constructed above and added here)
        listeners: list[DeviceListener] = [self.metrics.on_device_event, device_changes]
        self.manager = DeviceManager(self.registry, checkpoint, PluginClient, listeners, config.dial_timeout)
        registration = RegistrationServicer(self.manager, config.plugin_dir, self.metrics.count_registration)
        self.registration = RegistrationServer(registration, config.plugin_dir)
        self._watcher_ready = asyncio.Event()
        self._watcher = (
            PluginWatcher(config.plugins_registry_dir, self.manager, config.dial_timeout)
            if config.plugins_registry_dir is not None
            else None
        )

        # -- admission --------------------------------------------------------------------------------------------
        numa = range(config.numa_nodes) if config.numa_nodes is not None else detect_numa_nodes()
        parts = AdmissionParts(
            table=self.pods,
            pod_devices=self.pod_devices,
            allocator=Allocator(self.registry, self.pod_devices),
            registry=self.registry,
            store=self.allocation_store,
            plugins=PluginCalls(self.manager, self.metrics, config.allocate_timeout),
            device_changes=device_changes,
            metrics=self.metrics,
        )
        settings = AdmissionSettings(config.topology_policy, tuple(sorted(numa)), config.startup_plugin_wait)
        self.admission = AdmissionRunner(self.pods, self.pod_devices, self.allocation_store, Admitter(parts, settings))
        # extension point: pod sources (an API-server pod watch is appended here)
        self.pod_sources: list[PodSource] = []
        if config.pod_manifest_dir is not None:
            self.pod_sources.append(StaticPodDirectory(config.pod_manifest_dir, config.node_name))
        for source in self.pod_sources:
            self.pods.register_source(source.name)

        # -- serving ----------------------------------------------------------------------------------------------
        self.views = ApiViews(self.registry, self.pods, self.pod_devices, config.node_name)
        self._pod_resources = PodResourcesServicer(self.pods, self.pod_devices, self.registry)
        self._pod_resources_server: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

        # -- background tasks -------------------------------------------------------------------------------------
        # extension point: background tasks, (name, coroutine function); supervised, started in this order after
        # the servers. Each pod source is its own task, so one failing does not stop the others.
        self.background: list[tuple[str, TaskFactory]] = [
            ("grace-period-expiry", self.manager.expire_loop),
            ("registration-socket", self.registration.keep_serving),
            ("checkpoint-pacer", self.allocation_store.run_checkpoints),
            *[(f"pod-source:{s.name}", functools.partial(s.run, self.admission)) for s in self.pod_sources],
        ]
        self._admitting = False
        self._ready = False

    # -- probes -----------------------------------------------------------------------------------------------------

    def _health(self) -> str | None:
        return self.registration.problem()

    def _readiness(self) -> str | None:
        if not self._ready:
            return "starting"
        return self._health() or self.supervisor.problem()

    # -- lifecycle --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        plugin_dir = self.config.plugin_dir
        plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        restored = self._checkpoint_file.read()
        if restored is not None and restored.RegisteredDevices:
            log.info("checkpoint restored", extra={"resources": sorted(restored.RegisteredDevices)})
        self.manager.restore(restored)
        self.admission.restore(restored)
        removed = cleanup_plugin_dir(plugin_dir)
        if removed:
            log.info("removed stale sockets", extra={"sockets": removed})

        await self.registration.start()
        app = build_app(self.views.devices, self.views.pods, self.metrics.prometheus, self._health, self._readiness)
        if debug_faults_enabled():
            add_fault_route(app, self.supervisor)
        self._http = await serve(app, self.config.http_addr)
        self.supervisor.start()
        if self._watcher is not None:
            # Plugins already in the registry dir are found before admission starts.
            self.supervisor.add("plugin-watcher", self._run_watcher)
            await self._watcher_ready.wait()
        self.admission.start()
        self._admitting = True
        self._pod_resources_server = await serve_pod_resources(self._pod_resources, self.config.pod_resources_socket)
        for name, run in self.background:
            self.supervisor.add(name, run)
        self._ready = True
        log.info(
            "agent started",
            extra={"socket": str(self.registration.socket), "http": self.config.http_addr, "pid": os.getpid()},
        )

    async def _run_watcher(self) -> None:
        if self._watcher is not None:
            await self._watcher.run(self._watcher_ready)

    async def stop(self) -> None:
        self._ready = False
        await self.supervisor.stop()
        await self.registration.stop()
        if self._pod_resources_server is not None:
            await self._pod_resources_server.stop(grace=0.5)
            self._pod_resources_server = None
        if self._admitting:
            await self.admission.stop()
        await self.manager.stop()
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        log.info("agent stopped")


async def run_agent(config: AgentConfig) -> int:
    agent = Agent(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
    except OSError as err:
        log.error("agent failed to start: %s", err)
        await agent.stop()
        return 1
    await stop.wait()
    await agent.stop()
    return 0
