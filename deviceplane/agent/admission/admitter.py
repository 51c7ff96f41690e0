"""One pod's admission, from waiting for its plugins to its durable record, and the release of what a pod holds.

Init containers then app containers (core.admission_plan drives the choice; `PluginCalls` runs its RPCs, each with
a deadline). Then PreStartContainer is called where the plugin asks (30 s, as upstream), then the journal records
are made durable, and only then is the pod reported admitted; until then the pod is kept out of the checkpoint, so
whatever a restart restores has completed admission. Any failure releases everything the admission took.

Nothing is locked across an RPC: choosing and reserving devices happen in one synchronous step, so concurrent
admissions never share a device, and a slow plugin only delays the admissions that need it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from deviceplane.agent.admission.plugin_calls import PluginCalls
from deviceplane.agent.busy_poll import BusyPoll
from deviceplane.agent.in_flight import InFlight
from deviceplane.agent.plugins.startup_wait import StartupPluginWait
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.state.durability import AllocationStore
from deviceplane.core.admission_plan import AllocateCall, PodOutcome, admit_pod, pre_start_calls
from deviceplane.core.allocator import AllocationError, AllocationResult, Allocator, check_restored
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodRecord, PodTable
from deviceplane.core.pods import Pod
from deviceplane.core.topology import POLICY_NONE

log = logging.getLogger("deviceplane.admission")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    policy: str = POLICY_NONE
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AdmissionParts:
    """What admission works with, built by the composition root (agent/app.py)."""

    table: PodTable
    pod_devices: PodDevices
    allocator: Allocator
    store: AllocationStore
    plugins: PluginCalls
    plugins_back: StartupPluginWait  # right after start, admissions wait for their plugins to come back
    metrics: AgentMetrics
    # Told (source, pod, reason) when an admission fails: the API pod source's Warning Events.
    failure_listeners: Sequence[Callable[[str, Pod, str], None]] = ()
    # Armed while an admission alone in flight waits for its plugin (busy_poll.py); the default never polls.
    busy_poll: BusyPoll = field(default_factory=lambda: BusyPoll(0.0))


class Admitter:
    def __init__(
        self, parts: AdmissionParts, settings: AdmissionSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._table = parts.table
        self._pod_devices = parts.pod_devices
        self._allocator = parts.allocator
        self._store = parts.store
        self._plugins = parts.plugins
        self._plugins_back = parts.plugins_back
        self._metrics = parts.metrics
        self._failure_listeners = tuple(parts.failure_listeners)
        self._busy_poll = parts.busy_poll
        self._settings = settings
        self._clock = clock
        self._in_flight = InFlight(clock)  # admissions running now

    def quiet_for(self) -> float:
        """Seconds since the last admission ended; 0 while one runs."""
        return self._in_flight.quiet_for()

    async def admit(self, record: PodRecord) -> None:
        with self._in_flight:
            await self._admit(record)

    async def _admit(self, record: PodRecord) -> None:
        pod = record.pod
        started = self._clock()
        try:
            await self._wait_for_plugins(record)
            self._store.begin(pod.uid)
            outcome = await self._allocate(pod)
            timed = False  # restored pods, and pods that got no device, are not admissions the histogram times
            if outcome.restored:
                self._commit(pod)
            else:
                # PreStartContainer (the container's start) comes before durability: a crash in between leaves
                # nothing restorable, so a restored pod has always had its PreStart.
                for call in pre_start_calls(self._allocator, pod):
                    await self._plugin_call(self._plugins.pre_start(call))
                timed = await self._durable(pod)
        except asyncio.CancelledError:
            self.release(pod.uid, "admission cancelled")
            raise
        except AllocationError as err:
            self._fail(record, str(err), err.kind, err.resource)
            self._metrics.observe_admission(False, self._clock() - started)
        except Exception as err:  # a bug must fail this pod, not the agent
            log.exception("admission failed unexpectedly", extra={"pod": pod.key})
            self._fail(record, f"internal error: {err}", AllocationResult.INTERNAL, "")
            self._metrics.observe_admission(False, self._clock() - started)
        else:
            if timed:
                self._metrics.observe_admission(True, self._clock() - started)
            if self._table.get(pod.uid) is record:
                record.admitted(outcome.restored)
                if log.isEnabledFor(logging.INFO):  # skips building the record per admission below info
                    log.info(
                        "pod admitted",
                        extra={"pod": pod.key, "uid": pod.uid, "restored": outcome.restored,
                               "seconds": round(self._clock() - started, 6)},
                    )  # fmt: skip

    def release(self, uid: str, why: str) -> None:
        """Free everything the pod holds or has reserved (journaled)."""
        self._store.abandon(uid)
        released = self._allocator.release_pod(uid)
        if released:
            self._store.released(uid)
            log.info("devices released", extra={"uid": uid, "reason": why, "entries": len(released)})

    def _fail(self, record: PodRecord, reason: str, kind: AllocationResult, resource: str) -> None:
        self._metrics.count_allocation(resource, kind)
        self.release(record.pod.uid, "admission failed")
        record.failed(reason)
        log.warning(
            "pod admission failed",
            extra={"pod": record.pod.key, "uid": record.pod.uid, "reason": reason, "result": str(kind)},
        )
        for listener in self._failure_listeners:
            listener(record.source, record.pod, reason)

    async def _wait_for_plugins(self, record: PodRecord) -> None:
        """Right after start, give plugins a moment to come back before deciding their resources are missing. A pod
        restored from the checkpoint needs no plugin (no RPC is made for it), so it does not wait; one that waits
        says so in its reason."""
        if self._plugins_back.over():
            return
        pod = record.pod
        if check_restored(self._pod_devices, pod.uid, [(c.name, c.limits) for c in pod.all_containers]):
            return
        # Zero requests too: upstream still refuses them while a resource has no healthy device.
        wanted = sorted({r for c in pod.all_containers for r, _ in c.limits})
        try:
            await self._plugins_back.wait_for(
                wanted, lambda missing: record.waiting(self._plugins_back.reason(missing))
            )
        finally:
            record.waiting("")

    async def _allocate(self, pod: Pod) -> PodOutcome:
        steps = admit_pod(self._allocator, pod, self._settings.policy, self._settings.numa_nodes)
        try:
            step = next(steps)
            while True:
                if isinstance(step, AllocateCall):
                    step = steps.send(await self._plugin_call(self._plugins.allocate(step)))
                else:
                    step = steps.send(await self._plugin_call(self._plugins.preferred(step)))
        except StopIteration as done:
            outcome: PodOutcome = done.value
            return outcome
        finally:
            steps.close()

    async def _plugin_call(self, call: Awaitable[T]) -> T:
        """Await a plugin RPC; alone in flight, the loop polls through the wait instead of sleeping (busy_poll.py)."""
        if self._in_flight.count != 1:
            return await call
        self._busy_poll.arm()
        try:
            return await call
        finally:
            self._busy_poll.disarm()

    def _commit(self, pod: Pod) -> None:
        """The admission is complete: the pod may enter the checkpoint. Run-option conflicts (spec §4.10: the first
        value wins, upstream only logs the others) are logged here, once per container."""
        self._store.commit(pod.uid)
        for container in pod.all_containers:
            conflicts = self._pod_devices.run_option_conflicts(
                pod.uid, container.name, [r for r, _ in container.limits]
            )
            if conflicts:
                log.warning(
                    "conflicting run options",
                    extra={"pod": pod.key, "uid": pod.uid, "container": container.name, "conflicts": conflicts},
                )

    async def _durable(self, pod: Pod) -> bool:
        """Commit the pod, journal its allocations and wait until they are on disk (see AllocationStore.allocated
        for why appending them here, after PreStartContainer, keeps the journal's order). Alone in flight, the
        journal may write them at once on this thread: no other admission could share the write or use the loop.
        False when the pod holds no device (nothing to write)."""
        self._commit(pod)
        allocations = list(self._pod_devices.allocations(pod.uid))
        if not allocations:
            return False
        await self._store.allocated(allocations, inline=self._in_flight.count == 1)
        return True
