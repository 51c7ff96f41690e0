"""Admitting pods: devices for every container, exactly as the kubelet would, durably (DESIGN "Admission").

Per pod: init containers then app containers (core.admission_plan drives the choice; this module runs its RPCs),
one Allocate per container per resource with a deadline (`allocate_timeout`, default 10 s: upstream has none, and a
hanging plugin would otherwise hold its reservation forever; only admissions asking that plugin fail). Then
PreStartContainer is called where the plugin asks (30 s, as upstream), then the journal records are made durable,
and only then is the pod reported admitted; until then the pod is kept out of the checkpoint, so whatever a restart
restores has completed admission. Any failure releases everything the admission took.

Concurrency: each pod is admitted by its own task; nothing is locked across an RPC. Choosing and reserving devices
happen in one synchronous step, so concurrent admissions never share a device, and a slow plugin only delays the
admissions that need it.

Release (spec §4.8): a pod removed from its source, or in phase Succeeded/Failed, frees its devices, but only once
every pod source has reported itself synced; pods restored from the checkpoint that no source knows are freed then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from deviceplane.agent.plugins.manager import DeviceEvent, DeviceManager
from deviceplane.agent.plugins.plugin_client import PluginClient
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.state.durability import AllocationStore
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.admission_plan import AllocateCall, PodOutcome, PreferredCall, admit_pod, pre_start_calls
from deviceplane.core.allocator import AllocationError, Allocator
from deviceplane.core.constants import PRE_START_TIMEOUT_SECONDS
from deviceplane.core.pod_devices import Allocation, PodDevices
from deviceplane.core.pods import Pod

log = logging.getLogger("deviceplane.admission")

ALLOCATE_TIMEOUT_SECONDS = 10.0
# After the agent starts, an admission waits this long for the plugins of the resources it needs to (re)register
# and report devices, instead of failing at once as the kubelet does (kubernetes#118559).
STARTUP_PLUGIN_WAIT_SECONDS = 10.0
GIL_SWITCH_INTERVAL_SECONDS = 0.001

ADMITTING = "admitting"
ADMITTED = "admitted"
FAILED = "failed"
TERMINATED = "terminated"


def go_rpc_error(err: grpc.aio.AioRpcError) -> str:
    """A gRPC error as Go's status error prints it (upstream passes plugin errors through verbatim)."""
    code = "".join(part.capitalize() for part in err.code().name.split("_"))
    return f"rpc error: code = {'OK' if code == 'Ok' else code} desc = {err.details() or ''}"


@dataclass(slots=True)
class PodRecord:
    pod: Pod
    source: str
    key: str
    state: str = ADMITTING
    reason: str = ""
    restored: bool = False
    task: asyncio.Task[None] | None = None
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # set when the admission has finished

    @property
    def live(self) -> bool:
        return self.state in (ADMITTING, ADMITTED) and not self.pod.terminal


@dataclass(slots=True)
class SourceError:
    source: str
    key: str
    error: str


class AdmissionController:
    def __init__(
        self,
        manager: DeviceManager,
        store_dir: Any,
        metrics: AgentMetrics | None = None,
        policy: str = "none",
        numa_nodes: Iterable[int] = (),
        allocate_timeout: float = ALLOCATE_TIMEOUT_SECONDS,
        startup_wait: float = STARTUP_PLUGIN_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.pod_devices = PodDevices()
        self.allocator = Allocator(manager.registry, self.pod_devices)
        self.store = AllocationStore(manager, self.pod_devices, store_dir)
        self.metrics = metrics
        self.policy = policy
        self.numa = sorted(numa_nodes)
        self.allocate_timeout = allocate_timeout
        self.startup_wait = startup_wait
        self.clock = clock
        self.started_at = clock()
        self.records: dict[str, PodRecord] = {}  # by pod UID
        self.by_key: dict[tuple[str, str], str] = {}  # (source, key) -> UID
        self.by_name: dict[str, str] = {}  # namespace/name -> UID
        self.errors: dict[tuple[str, str], SourceError] = {}
        self.sources: set[str] = set()
        self.synced_sources: set[str] = set()
        self._device_change = asyncio.Event()
        # Told (source, pod, reason) when an admission fails: the API source's Warning Events.
        self.failure_observers: list[Callable[[str, Pod, str], None]] = []
        manager.observers.append(self._on_device_event)

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def restore(self, data: Any) -> None:
        loaded, applied = self.store.restore(data)
        if loaded or applied:
            log.info(
                "allocations restored",
                extra={"entries": loaded, "journal_records": applied, "pods": len(self.pod_devices.pods())},
            )

    def start(self) -> None:
        self.started_at = self.clock()
        # Checkpoint encoding runs in a worker thread; with the default 5 ms GIL switch interval every wake-up of
        # the event loop could wait that long behind it. 1 ms keeps admission latency flat while a checkpoint of
        # thousands of entries is written.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_SECONDS))
        self.store.start()

    async def stop(self) -> None:
        tasks = [r.task for r in self.records.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.close()

    def register_source(self, name: str) -> None:
        self.sources.add(name)

    @property
    def all_synced(self) -> bool:
        return self.sources <= self.synced_sources

    # -- what sources report -------------------------------------------------------------------------------------------

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        """A pod appeared or changed at (source, key)."""
        self.errors.pop((source, key), None)
        old_uid = self.by_key.get((source, key))
        if old_uid is not None and old_uid != pod.uid:
            self.pod_gone(source, key)
        record = self.records.get(pod.uid)
        if record is not None and (record.source, record.key) != (source, key):
            self.pod_error(source, key, f"pod UID {pod.uid} is already used by {record.source}:{record.key}")
            return
        other_uid = self.by_name.get(pod.key)
        if other_uid is not None and other_uid != pod.uid:
            other = self.records[other_uid]
            self.pod_error(source, key, f"pod {pod.key} is already defined by {other.source}:{other.key}")
            return
        self.by_key[(source, key)] = pod.uid
        if record is not None:
            # Same pod, updated: a pod's spec is immutable (as the API server enforces), only its phase moves on.
            record.pod = dataclasses.replace(record.pod, phase=pod.phase)
            if pod.terminal:
                self._terminate(record, f"pod phase {pod.phase}")
            return
        record = PodRecord(pod, source, key)
        self.records[pod.uid] = record
        self.by_name[pod.key] = pod.uid
        if pod.terminal:
            record.state = TERMINATED
            record.reason = f"pod phase {pod.phase}"
            record.admitted.set()
            self._release_when_synced(pod.uid)
            return
        record.task = asyncio.create_task(self._admit(record), name=f"admit {pod.key}")

    def pod_error(self, source: str, key: str, error: str) -> None:
        """The object at (source, key) is not a pod we can admit: reported, and any pod it held is gone."""
        if self.by_key.get((source, key)) is not None:
            self.pod_gone(source, key)
        log.warning("pod rejected", extra={"source": source, "key": key, "error": error})
        self.errors[(source, key)] = SourceError(source, key, error)

    def pod_gone(self, source: str, key: str) -> None:
        self.errors.pop((source, key), None)
        uid = self.by_key.pop((source, key), None)
        if uid is None:
            return
        record = self.records.pop(uid, None)
        if record is None:
            return
        if self.by_name.get(record.pod.key) == uid:
            del self.by_name[record.pod.key]
        if record.task is not None and not record.task.done():
            record.task.cancel()  # its own cleanup releases what it took
        self._release_when_synced(uid)

    def synced(self, source: str) -> None:
        self.synced_sources.add(source)
        if self.all_synced:
            self.collect_garbage()

    def collect_garbage(self) -> list[str]:
        """Upstream UpdateAllocatedDevices: free pods no source knows as live (only once all are synced)."""
        if not self.all_synced:
            return []
        live = {uid for uid, record in self.records.items() if record.live}
        gone = [uid for uid in self.pod_devices.pods() if uid not in live]
        for uid in gone:
            self._release(uid, "pod no longer active")
        return gone

    # -- admission -----------------------------------------------------------------------------------------------------

    async def _admit(self, record: PodRecord) -> None:
        pod = record.pod
        started = self.clock()
        try:
            await self._wait_for_plugins(pod)
            self.store.begin(pod.uid)
            outcome = await self._allocate(pod)
            if outcome.restored:
                self._commit(pod)
            else:
                # PreStartContainer (the container's start) comes before durability: a crash in between leaves
                # nothing restorable, so a restored pod has always had its PreStart.
                await self._pre_start(pod)
                await self._durable(pod)
        except asyncio.CancelledError:
            self._release(pod.uid, "admission cancelled")
            raise
        except AllocationError as err:
            self._fail(record, str(err), err.kind)
        except Exception as err:  # a bug must fail this pod, not the agent
            log.exception("admission failed unexpectedly", extra={"pod": pod.key})
            self._fail(record, f"internal error: {err}", "internal")
        else:
            if self.records.get(pod.uid) is record:
                record.state = ADMITTED
                record.restored = outcome.restored
                log.info(
                    "pod admitted",
                    extra={"pod": pod.key, "uid": pod.uid, "restored": outcome.restored,
                           "seconds": round(self.clock() - started, 6)},
                )  # fmt: skip
        finally:
            record.admitted.set()

    def _fail(self, record: PodRecord, reason: str, kind: str) -> None:
        self._release(record.pod.uid, "admission failed")
        record.state = FAILED
        record.reason = reason
        log.warning("pod admission failed", extra={"pod": record.pod.key, "uid": record.pod.uid, "reason": reason})
        for observer in self.failure_observers:
            observer(record.source, record.pod, reason)

    async def _wait_for_plugins(self, pod: Pod) -> None:
        """Right after start, give plugins a moment to come back before deciding their resources are missing."""
        # Zero requests too: upstream still refuses them while a resource has no healthy device.
        wanted = sorted({r for c in pod.all_containers for r, _ in c.limits})
        while self.clock() - self.started_at < self.startup_wait:
            missing = [r for r in wanted if not self._plugin_ready(r)]
            if not missing:
                return
            self._device_change.clear()
            remaining = self.startup_wait - (self.clock() - self.started_at)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._device_change.wait(), max(remaining, 0.001))

    def _plugin_ready(self, resource: str) -> bool:
        state = self.manager.registry.resources.get(resource)
        return state is not None and state.connected and bool(state.all_devices)

    def _on_device_event(self, _event: DeviceEvent) -> None:
        self._device_change.set()

    async def _allocate(self, pod: Pod) -> PodOutcome:
        steps = admit_pod(self.allocator, pod, self.policy, self.numa)
        try:
            step = next(steps)
            while True:
                if isinstance(step, AllocateCall):
                    step = steps.send(await self._call_allocate(step))
                else:
                    step = steps.send(await self._call_preferred(step))
        except StopIteration as done:
            outcome: PodOutcome = done.value
            return outcome
        finally:
            steps.close()

    async def _call_allocate(self, call: AllocateCall) -> pb.ContainerAllocateResponse:
        client = self._client(call.resource, "unknown Device Plugin {}")
        started = time.perf_counter()
        try:
            response = await client.allocate(call.devices, self.allocate_timeout)
        except grpc.aio.AioRpcError as err:
            kind = "timeout" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "rpc_error"
            self._count(call.resource, kind)
            raise AllocationError(go_rpc_error(err), kind) from err
        finally:
            if self.metrics is not None:
                self.metrics.alloc_duration.labels(call.resource).observe(time.perf_counter() - started)
        if not response.container_responses:
            self._count(call.resource, "empty_response")
            raise AllocationError(f"no containers return in allocation response {response}", "empty_response")
        self._count(call.resource, "success")
        return response.container_responses[0]

    async def _call_preferred(self, call: PreferredCall) -> set[str]:
        client = self._client(call.resource, "endpoint not found in cache for a registered resource: {}")
        request = call.request
        try:
            response = await client.get_preferred_allocation(
                request.available, request.must_include, request.size, self.allocate_timeout
            )
        except grpc.aio.AioRpcError as err:
            self._count(call.resource, "preferred_rpc_error")
            raise AllocationError(
                f"device plugin GetPreferredAllocation rpc failed with err: {go_rpc_error(err)}", "preferred_rpc_error"
            ) from err
        if not response.container_responses:
            return set()
        return set(response.container_responses[0].deviceIDs)

    async def _pre_start(self, pod: Pod) -> None:
        for call in pre_start_calls(self.allocator, pod):
            client = self._client(call.resource, "endpoint not found in cache for a registered resource: {}")
            try:
                await client.pre_start_container(call.devices, PRE_START_TIMEOUT_SECONDS)
            except grpc.aio.AioRpcError as err:
                self._count(call.resource, "pre_start_error")
                raise AllocationError(
                    f"device plugin PreStartContainer rpc failed with err: {go_rpc_error(err)}", "pre_start_error"
                ) from err

    def _client(self, resource: str, missing: str) -> PluginClient:
        client = self.manager.client(resource)
        if client is None:
            self._count(resource, "no_endpoint")
            raise AllocationError(missing.format(resource), "no_endpoint")
        return client

    def _count(self, resource: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.allocations_total.labels(resource, result).inc()

    def _commit(self, pod: Pod) -> None:
        """The admission is complete: the pod may enter the checkpoint. Run-option conflicts (spec §4.10: the first
        value wins, upstream only logs the others) are logged here, once per container."""
        self.store.commit(pod.uid)
        for container in pod.all_containers:
            options = self.pod_devices.run_options(pod.uid, container.name, [r for r, _ in container.limits])
            if options is not None and options.conflicts:
                log.warning(
                    "conflicting run options",
                    extra={"pod": pod.key, "uid": pod.uid, "container": container.name,
                           "conflicts": options.conflicts},
                )  # fmt: skip

    async def _durable(self, pod: Pod) -> None:
        """Commit the pod, journal its allocations and wait until they are on disk (see AllocationStore.allocated
        for why appending them here, after PreStartContainer, keeps the journal's order)."""
        self._commit(pod)
        futures = [self.store.allocated(a) for a in self.pod_devices.allocations(pod.uid)]
        if futures:
            await asyncio.gather(*futures)

    # -- release -------------------------------------------------------------------------------------------------------

    def _terminate(self, record: PodRecord, reason: str) -> None:
        if record.task is not None and not record.task.done():
            record.task.cancel()
        record.state = TERMINATED
        record.reason = reason
        self._release_when_synced(record.pod.uid)

    def _release_when_synced(self, uid: str) -> None:
        if self.all_synced:
            self._release(uid, "pod terminated")
        # otherwise the garbage collection at sync time frees it

    def _release(self, uid: str, why: str) -> None:
        self.store.abandon(uid)
        released = self.allocator.release_pod(uid)
        if released:
            self.store.released(uid)
            log.info("devices released", extra={"uid": uid, "reason": why, "entries": len(released)})

    # -- views ---------------------------------------------------------------------------------------------------------

    def allocated(self, resource: str) -> int:
        return self.pod_devices.allocated_count(resource)

    def holders(self) -> dict[tuple[str, str], tuple[str, str, str]]:
        """(resource, device) -> (namespace, pod name, container)."""
        out: dict[tuple[str, str], tuple[str, str, str]] = {}
        for key, (uid, container) in self.pod_devices.holder_map().items():
            record = self.records.get(uid)
            if record is not None:
                out[key] = (record.pod.namespace, record.pod.name, container)
            else:
                out[key] = ("", uid, container)  # restored, not (yet) known to any source
        return out

    def _resource_status(self, held: dict[str, Allocation]) -> list[dict[str, Any]]:
        """Per resource, each device's health as its plugin last reported it; unknown devices count as Healthy
        (spec §8: the device manager never reports Unknown)."""
        out = []
        for resource, allocation in sorted(held.items()):
            state = self.manager.registry.resources.get(resource)
            devices = state.all_devices if state is not None else {}
            out.append(
                {
                    "name": resource,
                    "resources": [
                        {
                            "resourceID": device_id,
                            "health": "Unhealthy"
                            if device_id in devices and not devices[device_id].is_healthy
                            else "Healthy",
                        }
                        for device_id in sorted(allocation.device_ids)
                    ],
                }
            )
        return out

    def pods_json(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for record in sorted(self.records.values(), key=lambda r: (r.pod.namespace, r.pod.name)):
            pod = record.pod
            containers = []
            for container in pod.all_containers:
                held = self.pod_devices.container_allocations(pod.uid, container.name)
                options = self.pod_devices.run_options(pod.uid, container.name, [r for r, _ in container.limits])
                containers.append(
                    {
                        "name": container.name,
                        "type": container.kind,
                        "devices": {r: sorted(a.device_ids) for r, a in held.items()},
                        "runOptions": options.to_json() if options is not None else None,
                        # KEP-4680 allocatedResourcesStatus: app containers only, as the kubelet fills it
                        "allocatedResourcesStatus": None if container.init else self._resource_status(held),
                    }
                )
            out.append(
                {
                    "namespace": pod.namespace,
                    "name": pod.name,
                    "uid": pod.uid,
                    "source": f"{record.source}:{record.key}",
                    "phase": pod.phase,
                    "state": record.state,
                    "admitted": record.state == ADMITTED,
                    "restored": record.restored,
                    "reason": record.reason,
                    "containers": containers,
                }
            )
        for error in sorted(self.errors.values(), key=lambda e: (e.source, e.key)):
            out.append(
                {
                    "namespace": None,
                    "name": None,
                    "uid": None,
                    "source": f"{error.source}:{error.key}",
                    "phase": None,
                    "state": "invalid",
                    "admitted": False,
                    "restored": False,
                    "reason": error.error,
                    "containers": [],
                }
            )
        return out
