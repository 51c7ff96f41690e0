"""The admission runner: the pod sources' sink (`PodSink`). It records what they report in the `PodTable` and runs
one `Admitter.admit` task per new pod.

Release (spec §4.8): a pod removed from its source, or in phase Succeeded/Failed, frees its devices, but only once
every pod source has reported itself synced; pods restored from the checkpoint that no source knows are freed then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from typing import NamedTuple

from deviceplane.agent.admission.admitter import Admitter
from deviceplane.agent.state.durability import AllocationStore
from deviceplane.aio import cancel_and_wait
from deviceplane.core.checkpoint import CheckpointData
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodRecord, PodTable
from deviceplane.core.pods import Pod

log = logging.getLogger("deviceplane.admission")

GIL_SWITCH_INTERVAL_SECONDS = 0.001


class AdmissionRunner:
    def __init__(self, table: PodTable, pod_devices: PodDevices, store: AllocationStore, admitter: Admitter) -> None:
        self._table = table
        self._pod_devices = pod_devices
        self._store = store
        self._admitter = admitter
        self._admissions: dict[str, _Admission] = {}  # in flight, by pod UID
        # The loop, found once: in CPython 3.11 get_running_loop() (create_task, current_task) makes a getpid()
        # syscall whenever another thread touched asyncio since, ~6 us here, several times per admission.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, list[Callable[[PodRecord | None], None]]] = {}  # told when the admission ends

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def restore(self, data: CheckpointData | None) -> None:
        """Blocking, at start: the checkpoint's allocations, then the journal on top."""
        loaded, applied = self._store.restore(data)
        if loaded or applied:
            log.info(
                "allocations restored",
                extra={"entries": loaded, "journal_records": applied, "pods": len(self._pod_devices.pods())},
            )

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Worker threads (the checkpoint file's write, the journal's writer while the disk is slow) hold the GIL
        # between their system calls; with the default 5 ms switch interval each time could delay the event loop
        # that long. 1 ms bounds it.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_SECONDS))
        self._store.start()

    async def stop_admitting(self) -> None:
        """Cancel the admissions in flight (each releases what it took)."""
        await cancel_and_wait([admission.task for admission in self._admissions.values()])

    async def close(self) -> None:
        """After `restore`: a last checkpoint, then the journal is closed. Call once the plugins are disconnected,
        so that last checkpoint, journaled as ours, is the one left on disk."""
        await self._store.close()

    async def settled(self, uid: str) -> PodRecord | None:
        """Wait until the pod's admission (if one is running) has finished; then its record. Cancelling the wait
        does not cancel the admission."""
        if uid in self._admissions:
            waiter: asyncio.Future[PodRecord | None] = (self._loop or asyncio.get_running_loop()).create_future()
            self._waiters.setdefault(uid, []).append(functools.partial(_wake, waiter))
            await asyncio.shield(waiter)
        return self._table.get(uid)

    def when_settled(self, uid: str, callback: Callable[[PodRecord | None], None]) -> None:
        """Call `callback(record)` once the pod's admission (if one is running) has finished: from the admission's
        last step itself, not a loop iteration later (the debug admit entry answers from it)."""
        if uid in self._admissions:
            self._waiters.setdefault(uid, []).append(callback)
        else:
            callback(self._table.get(uid))

    def known(self, source: str, key: str) -> bool:
        """A pod is recorded at (source, key)."""
        return self._table.uid_at(source, key) is not None

    # -- what sources report -------------------------------------------------------------------------------------------

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        """A pod appeared or changed at (source, key)."""
        self._table.clear_error(source, key)
        old_uid = self._table.uid_at(source, key)
        if old_uid is not None and old_uid != pod.uid:
            self.pod_gone(source, key)
        problem = self._table.conflict(source, key, pod)
        if problem is not None:
            self.pod_error(source, key, problem)
            return
        record = self._table.get(pod.uid)
        if record is not None:
            self._table.bind(source, key, pod.uid)
            record.phase_changed(pod.phase)
            if pod.terminal:
                self._terminate(record, f"pod phase {pod.phase}")
            return
        record = self._table.add(pod, source, key)
        if pod.terminal:
            record.terminated(f"pod phase {pod.phase}")
            self._release_when_synced(pod.uid)
            return
        task = (self._loop or asyncio.get_running_loop()).create_task(self._admit(record), name=f"admit {pod.key}")
        self._admissions[pod.uid] = _Admission(task, record)
        task.add_done_callback(functools.partial(self._task_done, record))

    def pod_error(self, source: str, key: str, error: str) -> None:
        """The object at (source, key) is not a pod we can admit: reported, and any pod it held is gone."""
        if self._table.uid_at(source, key) is not None:
            self.pod_gone(source, key)
        log.warning("pod rejected", extra={"source": source, "key": key, "error": error})
        self._table.set_error(source, key, error)

    def pod_gone(self, source: str, key: str) -> None:
        self._table.clear_error(source, key)
        record = self._table.remove_at(source, key)
        if record is None:
            return
        self._cancel(record.pod.uid)  # its own cleanup releases what it took
        self._release_when_synced(record.pod.uid)

    def synced(self, source: str) -> None:
        self._table.mark_synced(source)
        if self._table.all_synced:
            self.collect_garbage()

    def collect_garbage(self) -> list[str]:
        """Upstream UpdateAllocatedDevices: free pods no source knows as live (only once all are synced)."""
        if not self._table.all_synced:
            return []
        live = self._table.live_uids()
        gone = [uid for uid in self._pod_devices.pods() if uid not in live]
        for uid in gone:
            self._admitter.release(uid, "pod no longer active")
        return gone

    # -- release -------------------------------------------------------------------------------------------------------

    async def _admit(self, record: PodRecord) -> None:
        try:
            await self._admitter.admit(record)
        finally:
            self._ended(record)

    def _task_done(self, record: PodRecord, _task: asyncio.Task[None]) -> None:
        self._ended(record)  # a task cancelled before its first step never ran `_admit`'s finally

    def _ended(self, admitted: PodRecord) -> None:
        """The admission of `admitted` ended (in its last step): its waiters are told at once. A newer admission of
        the same UID (the pod removed and added again meanwhile) is left alone."""
        uid = admitted.pod.uid
        admission = self._admissions.get(uid)
        if admission is not None and admission.record is admitted:
            del self._admissions[uid]
            record = self._table.get(uid)
            for callback in self._waiters.pop(uid, ()):
                try:
                    callback(record)
                except Exception:  # one waiter's bug must not cost the others their answer
                    log.exception("admission waiter failed", extra={"uid": uid})

    def _cancel(self, uid: str) -> None:
        admission = self._admissions.get(uid)
        if admission is not None and not admission.task.done():
            admission.task.cancel()

    def _terminate(self, record: PodRecord, reason: str) -> None:
        self._cancel(record.pod.uid)
        record.terminated(reason)
        self._release_when_synced(record.pod.uid)

    def _release_when_synced(self, uid: str) -> None:
        if self._table.all_synced:
            self._admitter.release(uid, "pod terminated")
        # otherwise the garbage collection at sync time frees it


class _Admission(NamedTuple):
    task: asyncio.Task[None]
    record: PodRecord  # which admission of the UID (the pod may be removed and added again while one ends)


def _wake(waiter: asyncio.Future[PodRecord | None], record: PodRecord | None) -> None:
    if not waiter.done():
        waiter.set_result(record)
