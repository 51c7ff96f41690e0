"""The agent's composition root: every object of the agent is built here, in dependency order, and receives what it
uses through its constructor. Nothing is wired after construction.

Extension points (in `Agent.__init__`, each marked "extension point"):
- device listeners: objects told every `DeviceEvent` (metrics, admission's wake-up; a Node/NodeDevices publisher);
- pod sources: `PodSource`s feeding the admission runner (the static pod directory; an API-server watch);
- background tasks: named long-lived coroutines, run under the supervisor (agent/supervisor.py: restarted with
  backoff when they fail, counted, shown in /readyz) after the servers start, cancelled at stop.

Proxy mode (`kubelet_dir` set): the kubelet allocates. Instead of admission, pod sources and a PodResources server of
its own, the agent gets the proxy (deviceplane/agent/proxy/): the connector the manager dials plugins with, one proxy
endpoint per resource in the kubelet's directory, and owners from the kubelet's PodResources.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deviceplane.agent.admission.admitter import (
    AdmissionParts,
    AdmissionSettings,
    Admitter,
)
from deviceplane.agent.admission.plugin_calls import PluginCalls
from deviceplane.agent.admission.pod_source import PodSource, StaticPodDirectory
from deviceplane.agent.admission.runner import AdmissionRunner
from deviceplane.agent.busy_poll import BusyPoll
from deviceplane.agent.heap import SETTLE_INTERVAL_SECONDS, HeapKeeper
from deviceplane.agent.host import default_node_name, detect_numa_nodes
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.mode import CLUSTER_EXTRA_HINT, NODEDEVICES_DEBOUNCE_SECONDS, NODEDEVICES_MAX_DEVICES
from deviceplane.agent.plugin_dir_lock import PluginDirBusyError, PluginDirLock
from deviceplane.agent.plugins.contracts import DeviceListener, PluginConnector
from deviceplane.agent.plugins.manager import DeviceManager
from deviceplane.agent.plugins.plugin_client import PluginClient
from deviceplane.agent.plugins.plugin_watcher import PluginWatcher
from deviceplane.agent.plugins.registration import RegistrationServicer, cleanup_plugin_dir
from deviceplane.agent.plugins.registration_server import RegistrationServer
from deviceplane.agent.plugins.startup_wait import STARTUP_PLUGIN_WAIT_SECONDS, StartupPluginWait
from deviceplane.agent.proxy.mode import ProxyMode
from deviceplane.agent.proxy.ownership import Ownership
from deviceplane.agent.serving.api_views import ApiViews
from deviceplane.agent.serving.debug_admit import SOURCE as DEBUG_SOURCE
from deviceplane.agent.serving.debug_admit import DebugAdmitApi
from deviceplane.agent.serving.debug_faults import fault_routes
from deviceplane.agent.serving.duration_metrics import DurationsCollector
from deviceplane.agent.serving.http_api import api_routes
from deviceplane.agent.serving.lean_http import LeanHttpServer
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.serving.podresources import PodResourcesServer, PodResourcesServicer
from deviceplane.agent.serving.publish_metrics import NODE_STATUS, NODEDEVICES, PublishCollector
from deviceplane.agent.serving.state_metrics import busy_poll_seconds, journal_corrupt_records
from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.durability import AllocationStore, CheckpointContent, journal_checksums
from deviceplane.agent.state.journal import INLINE_SYNC_LIMIT_SECONDS, JOURNAL_DIRNAME, Journal, adopt_segments
from deviceplane.agent.supervisor import Supervisor
from deviceplane.agent.tasks import TaskFactory
from deviceplane.aio import cancel_and_wait
from deviceplane.core.allocator import Allocator
from deviceplane.core.checkpoint import CheckpointEncoder
from deviceplane.core.constants import ALLOCATE_TIMEOUT_SECONDS, DIAL_TIMEOUT_SECONDS, KUBELET_POD_RESOURCES_SOCKET
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodTable
from deviceplane.core.registry import DeviceRegistry
from deviceplane.core.topology import numa_nodes_problem
from deviceplane.debug_faults import debug_faults_enabled
from deviceplane.loop_watchdog import LOOP_STALL_SECONDS, loop_watchdog
from deviceplane.stop_signals import STOP_SIGNALS

if TYPE_CHECKING:
    from deviceplane.agent.kube.client import KubeApi
    from deviceplane.agent.kube.cluster_mode import ClusterMode

__all__ = ["Agent", "AgentConfig", "default_node_name", "run_agent"]

log = logging.getLogger("deviceplane.agent")

WATCHDOG_PREFIX = "deviceplane_agent"  # the loop watchdog's series: deviceplane_agent_event_loop_*

REQUIRE_APISERVER_TIMEOUT_SECONDS = 15.0


class ConfigError(Exception):
    """The configuration cannot work on this machine; the agent does not start."""


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
    # Proxy mode: in front of a real kubelet (its device-plugin dir and PodResources socket); None = the agent
    # allocates itself.
    kubelet_dir: Path | None = None
    kubelet_pod_resources_socket: Path = Path(KUBELET_POD_RESOURCES_SOCKET)
    require_apiserver: bool = False
    nodedevices_debounce: float = NODEDEVICES_DEBOUNCE_SECONDS
    nodedevices_max_devices: int = NODEDEVICES_MAX_DEVICES
    # Benchmarking aid (serving/debug_admit.py): "127.0.0.1:PORT" of a loopback admit endpoint; agent mode only.
    debug_admit_addr: str | None = None
    # The event-loop watchdog (loop_watchdog.py): a stall longer than this is logged with every thread's stack; 0 = off.
    loop_stall_seconds: float = LOOP_STALL_SECONDS
    # Full garbage collections at quiet moments (agent/heap.py): seconds between heap settles; 0 = CPython's own.
    gc_settle_interval: float = SETTLE_INTERVAL_SECONDS
    # An admission alone in flight writes its journal record on the loop while the last fdatasync took less than this
    # (state/journal.py); not a flag: tests raise it so that a slow CI disk does not change what they count.
    journal_inline_sync_limit: float = INLINE_SYNC_LIMIT_SECONDS


class Agent:
    def __init__(self, config: AgentConfig, busy_poll: BusyPoll | None = None) -> None:
        """`busy_poll`: the window the event loop's selector honours (agent/busy_poll.py; the loop must have been
        made by its `event_loop`); None: admissions never ask the loop to poll."""
        self.config = config
        busy_poll = busy_poll if busy_poll is not None else BusyPoll(0.0)

        # -- state: what the agent knows --------------------------------------------------------------------------
        self.registry = DeviceRegistry(config.grace_period)
        self.pod_devices = PodDevices()
        self.pods = PodTable()
        # Proxy mode: who holds which device is the kubelet's answer (its PodResources), not ours.
        self.ownership = Ownership(config.kubelet_pod_resources_socket) if config.kubelet_dir is not None else None
        allocated = self.ownership.allocated_count if self.ownership else self.pod_devices.allocated_count
        self.metrics = AgentMetrics(self.registry, config.node_name, allocated)
        # Every long-lived task runs under it (the background list below, the plugin watcher).
        self.supervisor = Supervisor(self.metrics.prometheus)
        # A thread that reports a blocked event loop, which /readyz and /metrics (served by that loop) cannot.
        self.loop_watchdog = loop_watchdog(config.loop_stall_seconds, self.metrics.prometheus, WATCHDOG_PREFIX)
        # Right after start, admissions and the first NodeDevices write wait for plugins to come back.
        self.plugins_back = StartupPluginWait(self.registry, config.startup_plugin_wait)
        # Proxy mode: the agent in front of a kubelet (its endpoints' registrations are part of the views).
        self.proxy: ProxyMode | None = None
        if config.kubelet_dir is not None and self.ownership is not None:
            self.proxy = ProxyMode(self.registry, config.plugin_dir, config.kubelet_dir, self.ownership, self.metrics)
        self.views = ApiViews(
            self.registry,
            self.pods,
            self.pod_devices,
            config.node_name,
            owners=self.ownership,
            pod_list=self.ownership.pods_json if self.ownership else None,
            kubelet_registered=self.proxy.kubelet_registered if self.proxy is not None else None,
            pod_resources=self.ownership.link if self.ownership else None,  # proxy mode's OwnersCurrent condition
        )

        # -- the kubelet checkpoint file, in a directory one agent at a time may serve ---------------------------
        self._dir_lock = PluginDirLock(config.plugin_dir)
        self._checkpoint_file = CheckpointStore(config.plugin_dir)

        # -- cluster mode: pods from the API server, Events, Node status, NodeDevices ------------------------------
        # (in proxy mode only NodeDevices: the kubelet admits pods and owns the Node's capacity)
        self.cluster = None if config.standalone else self._cluster_mode(proxy=config.kubelet_dir is not None)

        # -- durable state: the kubelet checkpoint and the allocation journal ---------------------------------------
        content = CheckpointContent(self.registry, self.pod_devices)
        self._journal_dir = config.plugin_dir / JOURNAL_DIRNAME
        journal = Journal(self._journal_dir, inline_sync_limit=config.journal_inline_sync_limit)
        checkpoint = CheckpointWriter(
            self._checkpoint_file.write_encoded,
            content.snapshot,
            CheckpointEncoder(),
            before_write=journal_checksums(journal),
        )
        self.metrics.prometheus.register(journal_corrupt_records(lambda: journal.corrupt_records))
        self.metrics.prometheus.register(
            DurationsCollector(
                "deviceplane_journal_sync_duration_seconds",
                "One durable write of the allocation journal (a group of records: write + fdatasync), which every "
                "admission and release waits for.",
                (),
                {(): journal.sync_durations},
            )
        )
        self.allocation_store = AllocationStore(self.pod_devices, journal, content, checkpoint)

        # -- plugin side ------------------------------------------------------------------------------------------
        # extension point: device listeners (a Node/NodeDevices publisher is constructed above and added here)
        listeners: list[DeviceListener] = [self.metrics.on_device_event, self.plugins_back]
        connector: PluginConnector = PluginClient
        if self.proxy is not None:
            connector = self.proxy.connector
            listeners.append(self.proxy.on_device_event)
        if self.cluster is not None:
            listeners += self.cluster.device_listeners()
        self.manager = DeviceManager(
            self.registry, checkpoint, connector, listeners, config.dial_timeout, self.metrics.count_snapshot
        )
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
        problem = numa_nodes_problem(config.topology_policy, len(numa))
        if problem is not None:
            raise ConfigError(f"--topology-policy {config.topology_policy} with {len(numa)} NUMA nodes: {problem}")
        parts = AdmissionParts(
            table=self.pods,
            pod_devices=self.pod_devices,
            allocator=Allocator(self.registry, self.pod_devices),
            store=self.allocation_store,
            plugins=PluginCalls(self.manager, self.metrics, config.allocate_timeout),
            plugins_back=self.plugins_back,
            metrics=self.metrics,
            failure_listeners=(self.cluster.events.failed,) if self.cluster and self.cluster.events else (),
            busy_poll=busy_poll,
        )
        self.metrics.prometheus.register(busy_poll_seconds(lambda: busy_poll.polled_seconds))
        settings = AdmissionSettings(config.topology_policy, tuple(sorted(numa)))
        admitter = Admitter(parts, settings)
        self.admission = AdmissionRunner(self.pods, self.pod_devices, self.allocation_store, admitter)
        # extension point: pod sources (an API-server pod watch is appended here)
        self.pod_sources: list[PodSource] = []
        if config.pod_manifest_dir is not None:
            self.pod_sources.append(StaticPodDirectory(config.pod_manifest_dir, config.node_name))
        if self.cluster is not None and self.cluster.pods is not None:
            self.pod_sources.append(self.cluster.pods)
        for source in self.pod_sources:
            self.pods.register_source(source.name)
        self._debug_admit = (
            DebugAdmitApi(self.admission, self.allocation_store.durable, config.node_name)
            if config.debug_admit_addr is not None and self.proxy is None
            else None
        )
        if self._debug_admit is not None:
            self.pods.register_source(DEBUG_SOURCE)

        # -- serving ----------------------------------------------------------------------------------------------
        self._pod_resources = PodResourcesServer(
            PodResourcesServicer(self.pods, self.pod_devices, self.registry), config.pod_resources_socket
        )
        routes = api_routes(self.views.devices, self.views.pods, self.metrics.exposition, self._health, self._readiness)
        if debug_faults_enabled():
            routes.update(fault_routes(self.supervisor))
        self._http = LeanHttpServer(routes)
        self._debug_http = LeanHttpServer(self._debug_admit.routes()) if self._debug_admit is not None else None

        # -- the heap: full collections when nothing is in flight ---------------------------------------------------
        self.heap = HeapKeeper(
            self.proxy.quiet_for if self.proxy is not None else admitter.quiet_for,
            self.metrics.prometheus,
            config.gc_settle_interval,
        )

        # -- background tasks -------------------------------------------------------------------------------------
        # extension point: background tasks, (name, coroutine function); supervised, started in this order after
        # the servers. Each pod source is its own task, so one failing does not stop the others.
        self.background: list[tuple[str, TaskFactory]] = [
            ("grace-period-expiry", self.manager.expire_loop),
            ("registration-socket", self.registration.keep_serving),
            ("checkpoint-pacer", self.allocation_store.run_checkpoints),
        ]
        if self.proxy is not None:
            self.background += self.proxy.tasks()
        else:
            # A removed PodResources socket is served again (proxy mode serves none: the kubelet's is read).
            self.background.append(("pod-resources-socket", self._pod_resources.keep_serving))
            self.background += [
                (f"pod-source:{source.name}", functools.partial(source.run, self.admission))
                for source in self.pod_sources
            ]
        if self.cluster is not None:
            self.background += self.cluster.background()
        if self.heap.settling:
            self.background.append(("heap-settle", self.heap.run))
        self._admitting = False
        self._restored = False
        self._ready = False

    def _cluster_mode(self, *, proxy: bool) -> ClusterMode:
        # Imported here: the Kubernetes client is an extra (`deviceplane[cluster]`), the standalone agent runs without.
        try:
            from deviceplane.agent.kube.client import KubeApi, api_client
            from deviceplane.agent.kube.cluster_mode import ClusterMode
            from deviceplane.agent.kube.events import AdmissionEvents
            from deviceplane.agent.kube.node_devices import NodeDevicesPublisher
            from deviceplane.agent.kube.node_status import NodeStatusPublisher
            from deviceplane.agent.kube.pod_watch import ApiPodSource
            from deviceplane.agent.kube.publishing import PublishRecord
        except ImportError as err:
            raise KubeError(f"{CLUSTER_EXTRA_HINT} ({err})") from err
        config = self.config
        api = KubeApi(api_client(config.kubeconfig))
        ownership = self.ownership
        # Each kept by its publisher and read by the metrics at scrape time.
        published = {NODEDEVICES: PublishRecord("NodeDevices")}
        node_devices = NodeDevicesPublisher(
            api,
            config.node_name,
            self.views.status,
            allocations=self._proxy_generation if ownership else (lambda: self.pod_devices.generation),
            # Proxy mode: not before the kubelet's owners are listed (agent mode restores its own at start).
            owners_known=ownership.listed.wait if ownership else None,
            plugins_back=self.plugins_back,
            record=published[NODEDEVICES],
            debounce=config.nodedevices_debounce,
            max_devices=config.nodedevices_max_devices,
        )
        if proxy:
            self.metrics.prometheus.register(PublishCollector(published))
            return ClusterMode(api=api, node_devices=node_devices)
        published[NODE_STATUS] = PublishRecord("node status")
        events = AdmissionEvents(api, config.node_name)
        self.metrics.prometheus.register(PublishCollector(published, lambda: events.dropped))
        return ClusterMode(
            api=api,
            node_devices=node_devices,
            pods=ApiPodSource(api, config.node_name),
            events=events,
            node_status=NodeStatusPublisher(
                api,
                config.node_name,
                self.registry.capacity,
                # Asked now, before start writes anything into the plugin dir (its socket, a fresh checkpoint).
                reset_extended_resources=self._checkpoint_file.should_reset_extended_resources(),
                record=published[NODE_STATUS],
            ),
        )

    def _proxy_generation(self) -> int:
        """Proxy mode: changes when the kubelet's owners, whether they are current, or an endpoint's registration
        with the kubelet do (both counters only grow), so NodeDevices is written again."""
        proxy, ownership = self.proxy, self.ownership
        registrations = proxy.registrations_generation if proxy is not None else 0
        return (ownership.generation if ownership is not None else 0) + registrations

    # -- probes -----------------------------------------------------------------------------------------------------

    def _health(self) -> str | None:
        return self.registration.problem()

    def _readiness(self) -> str | None:
        if not self._ready:
            # Start may wait on a supervised task (the plugin watcher's first look): say which, if it is failing.
            waiting_on = self.supervisor.problem()
            return "starting" if waiting_on is None else f"starting: {waiting_on}"
        problem = self._health() or self.supervisor.problem()
        if problem is None and self.ownership is not None:
            problem = self.ownership.ready()
        if problem is None and self.cluster is not None:
            problem = self.cluster.readiness()
        return problem

    # -- lifecycle --------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.loop_watchdog is not None:  # first, so a start that hangs is reported too
            self.loop_watchdog.start()
        if self.cluster is not None and self.config.require_apiserver:
            await self._check_apiserver(self.cluster.api)
        plugin_dir = self.config.plugin_dir
        plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._dir_lock.acquire()  # before anything in the directory is read, removed or bound
        restored = self._checkpoint_file.read()
        if restored is not None and restored.RegisteredDevices:
            log.info("checkpoint restored", extra={"resources": sorted(restored.RegisteredDevices)})
        self.manager.restore(restored)
        if self.proxy is not None:
            # Re-dial the plugins that were connected instead of removing their sockets (proxy/recovery.py).
            removed = await self.proxy.recover(self.manager.register)
        else:
            adopt_segments(plugin_dir, self._journal_dir)  # an earlier version journaled in the plugin directory
            self.admission.restore(restored)
            self._restored = True  # the journal is open: stop closes it, even if start is cut short after this
            removed = cleanup_plugin_dir(plugin_dir)
        if removed:
            log.info("removed stale sockets", extra={"sockets": removed})
        registered = (restored.RegisteredDevices if restored is not None else None) or {}
        self.plugins_back.restored({*registered, *self.pod_devices.devices()})

        await self.registration.start()
        await self._http.start(self.config.http_addr)
        self.supervisor.start()
        if self._watcher is not None:
            # Plugins already in the registry dir are found before admission starts.
            self.supervisor.add("plugin-watcher", self._run_watcher)
            await self._watcher_ready.wait()
        self.plugins_back.start()  # the startup plugin wait counts from here
        if self.proxy is None:  # in proxy mode the kubelet admits pods and serves PodResources
            self.admission.start()
            self._admitting = True
            if self._debug_http is not None and self.config.debug_admit_addr is not None:
                self.admission.synced(DEBUG_SOURCE)  # it has no pods before the first request
                await self._debug_http.start(self.config.debug_admit_addr)
            await self._pod_resources.start()
        # Last: what start built is long-lived, so it leaves the collector's generations.
        self.heap.start()
        for name, run in self.background:
            self.supervisor.add(name, run)
        self._ready = True
        log.info(
            "agent started",
            extra={"socket": str(self.registration.socket), "http": self.config.http_addr, "pid": os.getpid()},
        )

    async def _check_apiserver(self, api: KubeApi) -> None:
        from deviceplane.aio import off_loop

        try:
            version = await asyncio.wait_for(off_loop(api.version), REQUIRE_APISERVER_TIMEOUT_SECONDS)
        except (KubeError, TimeoutError) as err:
            raise KubeError(f"cannot reach the API server at {api.host} (--require-apiserver): {err}") from err
        log.info("API server reachable", extra={"server": api.host, "version": version})

    async def _run_watcher(self) -> None:
        if self._watcher is not None:
            await self._watcher.run(self._watcher_ready)

    async def stop(self) -> None:
        self._ready = False
        if not self._dir_lock.held:  # start failed before it took the directory: nothing there is ours
            self._stop_loop_watchdog()
            return
        await self.supervisor.stop()
        if self.proxy is not None:
            await self.proxy.stop()
        await self.registration.stop()
        await self._pod_resources.stop()
        if self._debug_http is not None:
            await self._debug_http.close()
        if self._admitting:
            await self.admission.stop_admitting()
        # Plugins disconnected first: their devices turn unhealthy, which changes the checkpoint, and the journal
        # (closed last) must name the checkpoint left on disk, or the next start takes it for a kubelet's.
        await self.manager.stop()
        if self._restored:
            await self.admission.close()
        await self._http.close()
        self.heap.stop()
        self._dir_lock.release()
        self._stop_loop_watchdog()
        log.info("agent stopped")

    def _stop_loop_watchdog(self) -> None:
        if self.loop_watchdog is not None:  # last, so a stop that hangs is reported too
            self.loop_watchdog.stop()


async def run_agent(config: AgentConfig, busy_poll: BusyPoll | None = None) -> int:
    try:
        agent = Agent(config, busy_poll)
    except (KubeError, ConfigError) as err:
        log.error("agent failed to start: %s", err)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        await _start_unless_stopped(agent, stop)
    except (OSError, KubeError, PluginDirBusyError) as err:
        log.error("agent failed to start: %s", err)
        await agent.stop()
        return 1
    await stop.wait()
    await agent.stop()
    return 0


async def _start_unless_stopped(agent: Agent, stop: asyncio.Event) -> None:
    """Start the agent; a stop signal meanwhile cuts start short at its current await. Start can wait long (the API
    server check, a plugin watcher that cannot start yet), and a signal must not wait for it: the caller then stops
    what start had built, as after a full start."""
    starting = asyncio.create_task(agent.start(), name="agent start")
    stopping = asyncio.create_task(stop.wait(), name="agent stop signal")
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait((starting, stopping))
    if starting.cancelled():
        log.info("stop signal during start")
        return
    starting.result()  # raises what start raised
