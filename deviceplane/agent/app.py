"""Wires the agent together: registration server, plugin watcher, device manager, HTTP, and clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from deviceplane import __version__
from deviceplane.agent.admission.admission import ALLOCATE_TIMEOUT_SECONDS, STARTUP_PLUGIN_WAIT_SECONDS
from deviceplane.agent.admission.allocation_service import AllocationService
from deviceplane.agent.kube.client import KubeApi, KubeError, api_client, off_loop
from deviceplane.agent.kube.events import AdmissionEvents
from deviceplane.agent.kube.node_devices import DEBOUNCE_SECONDS, MAX_DEVICES_PER_RESOURCE, NodeDevicesPublisher
from deviceplane.agent.kube.node_status import NodeStatusPublisher
from deviceplane.agent.kube.pod_watch import ApiPodSource
from deviceplane.agent.plugins.manager import DeviceManager
from deviceplane.agent.plugins.plugin_watcher import PluginWatcher
from deviceplane.agent.plugins.registration import RegistrationServicer, cleanup_plugin_dir
from deviceplane.agent.serving.http_api import build_app, serve
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.models import AgentView, DevicesStatus
from deviceplane.core.constants import DIAL_TIMEOUT_SECONDS, KUBELET_SOCKET_NAME
from deviceplane.core.names import is_extended_resource_name
from deviceplane.core.view import devices_status, rfc3339

log = logging.getLogger("deviceplane.agent")

SWEEP_INTERVAL_SECONDS = 1.0
REQUIRE_APISERVER_TIMEOUT_SECONDS = 15.0
# Bound for hostile registrations: the counter keeps one series for all invalid names.
INVALID_RESOURCE_LABEL = "<invalid>"


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
    require_apiserver: bool = False
    nodedevices_debounce: float = DEBOUNCE_SECONDS
    nodedevices_max_devices: int = MAX_DEVICES_PER_RESOURCE


class ClusterPublishing:
    """What the agent does with an API server: pods from a watch, Warning Events, Node status, NodeDevices."""

    def __init__(self, agent: Agent, api: KubeApi) -> None:
        config = agent.config
        self.api = api
        self.pods = ApiPodSource(api, config.node_name)
        self.events = AdmissionEvents(api, config.node_name, self.pods.name)
        self.node_status = NodeStatusPublisher(api, config.node_name, agent.manager.sweep)
        self.node_devices = NodeDevicesPublisher(
            api,
            config.node_name,
            agent.devices_status,
            debounce=config.nodedevices_debounce,
            max_devices=config.nodedevices_max_devices,
        )
        agent.manager.observers += [self.node_status.changed, self.node_devices.changed]
        agent.allocation.add_source(self.pods)
        agent.allocation.admission.failure_observers.append(self.events.failed)

    def loops(self) -> dict[str, Any]:
        """The long-lived coroutines, by task name."""
        return {
            "node-status": self.node_status.run(),
            "node-devices": self.node_devices.run(),
            "pod-events": self.events.run(),
        }

    def readiness(self) -> str | None:
        for part in (self.pods, self.node_status, self.node_devices):
            problem = part.ready()
            if problem is not None:
                return problem
        return None


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.store = CheckpointStore(config.plugin_dir)
        self.manager = DeviceManager(self.store, config.grace_period, config.dial_timeout)
        self.allocation = AllocationService(
            self.manager,
            config.plugin_dir,
            config.node_name,
            config.pod_resources_socket,
            config.pod_manifest_dir,
            config.topology_policy,
            config.numa_nodes,
            config.allocate_timeout,
            config.startup_plugin_wait,
        )
        self.metrics = AgentMetrics(self.manager, config.node_name, self.allocation.allocated)
        self.allocation.attach_metrics(self.metrics)
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False
        self.registration_socket = config.plugin_dir / KUBELET_SOCKET_NAME
        self.cluster = None if config.standalone else ClusterPublishing(self, KubeApi(api_client(config.kubeconfig)))

    # -- views ------------------------------------------------------------------------------------------------------

    def devices_status(self, device_limit: int | None = None, resource: str | None = None) -> DevicesStatus:
        return devices_status(
            self.manager.registry,
            self.manager.sweep(),
            AgentView(version=__version__, node=self.config.node_name, lastHeartbeatTime=rfc3339(time.time())),
            holders=self.allocation.holders(),
            device_limit=device_limit,
            resource_filter=(lambda name: name == resource) if resource else None,
        )

    def devices_json(self, request: web.Request | None = None) -> Any:
        query = request.query if request is not None else {}
        limit = None
        if "limit" in query:
            if not query["limit"].isdigit():
                raise web.HTTPBadRequest(text=f"limit must be a non-negative integer, got {query['limit']!r}")
            limit = int(query["limit"])
        return self.devices_status(limit, query.get("resource")).model_dump(mode="json")

    def pods_json(self, _request: web.Request | None = None) -> Any:
        return self.allocation.pods_json()

    def _health(self) -> str | None:
        if self._grpc is None or not self.registration_socket.exists():
            return "device plugin registration gRPC server failed and no device plugins can register"
        return None

    def _readiness(self) -> str | None:
        if not self._ready:
            return "starting"
        problem = self._health()
        if problem is None and self.cluster is not None:
            problem = self.cluster.readiness()
        return problem

    def _count_attempt(self, resource: str) -> None:
        label = resource if is_extended_resource_name(resource) else INVALID_RESOURCE_LABEL
        self.metrics.registration_total.labels(label).inc()

    # -- lifecycle --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.cluster is not None and self.config.require_apiserver:
            await self._check_apiserver(self.cluster.api)
        plugin_dir = self.config.plugin_dir
        plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        restored = self.manager.restore()
        if restored is not None:
            log.info("checkpoint restored", extra={"resources": sorted(restored.RegisteredDevices or {})})
        self.allocation.restore(restored)
        removed = cleanup_plugin_dir(plugin_dir)
        if removed:
            log.info("removed stale sockets", extra={"sockets": removed})

        await self._serve_registration()

        app = build_app(self.devices_json, self.pods_json, self.metrics.registry, self._health, self._readiness)
        self._http = await serve(app, self.config.http_addr)
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="capacity-sweep"))
        if self.config.plugins_registry_dir is not None:
            watcher = PluginWatcher(self.config.plugins_registry_dir, self.manager, self.config.dial_timeout)
            watching = asyncio.Event()
            self._tasks.append(asyncio.create_task(watcher.run(watching), name="plugin-watcher"))
            await watching.wait()
        await self.allocation.start()
        if self.cluster is not None:
            for name, loop in self.cluster.loops().items():
                self._tasks.append(asyncio.create_task(loop, name=name))
        self._ready = True
        log.info(
            "agent started",
            extra={"socket": str(self.registration_socket), "http": self.config.http_addr, "pid": os.getpid()},
        )

    async def _check_apiserver(self, api: KubeApi) -> None:
        try:
            version = await asyncio.wait_for(off_loop(api.version), REQUIRE_APISERVER_TIMEOUT_SECONDS)
        except (KubeError, TimeoutError) as err:
            raise KubeError(f"cannot reach the API server at {api.host} (--require-apiserver): {err}") from err
        log.info("API server reachable", extra={"server": api.host, "version": version})

    async def _serve_registration(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
            self._grpc = None
        server = grpc.aio.server()
        servicer = RegistrationServicer(self.manager, self.config.plugin_dir, self._count_attempt)
        pb_grpc.add_RegistrationServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{self.registration_socket}")
        await server.start()
        self._grpc = server

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            self.manager.sweep()
            if not self.registration_socket.exists():
                # Someone removed kubelet.sock: serve again, so plugins watching for it re-register. (The kubelet
                # would only fail its health check.) Connected plugins are unaffected.
                log.warning(
                    "registration socket disappeared; serving again", extra={"socket": str(self.registration_socket)}
                )
                try:
                    self.config.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
                    await self._serve_registration()
                except (OSError, RuntimeError) as err:
                    log.error("cannot serve the registration socket: %s", err)

    async def stop(self) -> None:
        self._ready = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._grpc is not None:
            await self._grpc.stop(grace=1)
            self._grpc = None
        await self.allocation.stop()
        await self.manager.stop()
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        with contextlib.suppress(FileNotFoundError):
            self.registration_socket.unlink()
        log.info("agent stopped")


async def run_agent(config: AgentConfig) -> int:
    try:
        agent = Agent(config)
    except KubeError as err:
        log.error("agent failed to start: %s", err)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
    except (OSError, KubeError) as err:
        log.error("agent failed to start: %s", err)
        await agent.stop()
        return 1
    await stop.wait()
    await agent.stop()
    return 0


def default_node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname()
