"""Durable allocations: the journal for each change, the kubelet-format checkpoint in the background.

An admission is durable once its journal records are fdatasync'd (one small append, group-committed). The
kubelet-format checkpoint `kubelet_internal_checkpoint` is rewritten in the background, coalesced and paced by its
own cost, so its O(pods) rewrite never sits on an admission's path; after each such rewrite the journal segments it
covers are deleted. At start: the checkpoint, then every remaining journal segment replayed on top (idempotent).

The checkpoint file is always a complete, valid kubelet checkpoint (atomic rename); it may lag the journal by one
pacing interval, which only matters to a reader that ignores the journal (a kubelet taking over the directory).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.journal import Journal, alloc_record, checkpoint_record, release_record
from deviceplane.core.checkpoint import CheckpointData, checksum
from deviceplane.core.pod_devices import Allocation, PodDevices
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.durability")

# The background checkpoint runs at most this often, and never more than 1/PACING of the time: its encoding is
# pure-Python work on the event loop, in slices between admissions (5,000 entries: ~40 ms when all are new, ~6 ms
# when their texts are kept from the last checkpoint, core.checkpoint.CheckpointEncoder; plus the write and its
# fsyncs in a worker thread: benchmarks/checkpoint_encode.py).
MIN_CHECKPOINT_INTERVAL_SECONDS = 1.0
CHECKPOINT_PACING = 50.0


class CheckpointContent:
    """What the kubelet checkpoint holds: every registered resource's healthy devices and the allocations of pods
    whose admission has finished. Pods still being admitted (PreStartContainer included) are kept out, so a crash
    can only ever restore pods that completed admission."""

    def __init__(self, registry: DeviceRegistry, pod_devices: PodDevices) -> None:
        self._registry = registry
        self._pod_devices = pod_devices
        self._pending: set[str] = set()

    def begin(self, pod_uid: str) -> None:
        self._pending.add(pod_uid)

    def end(self, pod_uid: str) -> None:
        self._pending.discard(pod_uid)

    def snapshot(self) -> CheckpointData:
        """Cheap (copies of the entries' and the registry's lists: at 5,000 entries ~0.03 ms in isolation, 0.2-0.8 ms
        in the agent), taken on the loop in one step; the writer then encodes it in slices."""
        entries = self._pod_devices.entries(without_pods=self._pending)
        # PodDeviceEntries stays nil (null) while nothing is allocated, exactly as the kubelet writes it.
        return CheckpointData(PodDeviceEntries=entries or None, RegisteredDevices=self._registry.registered_healthy())


class AllocationStore:
    def __init__(
        self, pod_devices: PodDevices, journal: Journal, content: CheckpointContent, checkpoint: CheckpointWriter
    ) -> None:
        self._pod_devices = pod_devices
        self._journal = journal
        self._content = content
        self._checkpoint = checkpoint
        self._dirty = asyncio.Event()
        self.checkpoints = 0
        self.last_checkpoint_seconds = 0.0

    def restore(self, data: CheckpointData | None) -> tuple[int, int]:
        """Checkpoint entries, then the journal on top; returns (entries loaded, journal records applied). Blocking."""
        loaded = 0
        if data is not None and data.PodDeviceEntries:
            skipped = self._pod_devices.load(data.PodDeviceEntries)
            loaded = len(data.PodDeviceEntries) - skipped
        applied = self._journal.replay(self._pod_devices, None if data is None else checksum(data))
        self._journal.open()
        return loaded, applied

    @property
    def journal_syncs(self) -> int:
        return self._journal.syncs

    @property
    def journal_inline_syncs(self) -> int:
        """Of `journal_syncs`, those written on the event loop (an admission alone in flight)."""
        return self._journal.inline_syncs

    def start(self) -> None:
        self._dirty.set()  # fold the replayed journal into a fresh checkpoint at once (`run_checkpoints` does)

    # -- changes -------------------------------------------------------------------------------------------------------

    def begin(self, pod_uid: str) -> None:
        """An admission starts: its allocations stay out of the checkpoint until `commit` or `abandon`."""
        self._content.begin(pod_uid)

    def commit(self, pod_uid: str) -> None:
        """Call in the same loop step as the pod's `allocated` appends (journal and checkpoint then agree)."""
        self._content.end(pod_uid)

    def abandon(self, pod_uid: str) -> None:
        """A failed admission: nothing of it is pending any more (its release is journaled)."""
        self._content.end(pod_uid)

    def allocated(self, allocations: Sequence[Allocation], inline: bool = False) -> asyncio.Future[None]:
        """Journal allocations already applied to PodDevices, as one group; the future resolves once they are on
        disk. `inline`: no other admission is in flight, so the journal may write them at once (Journal.append_all).

        The caller appends a pod's allocations at the end of its admission, after PreStartContainer, not when each
        was applied. That keeps replay equal to memory because the order only matters per pod: records of different
        pods touch different entries (alloc sets one entry, release drops one pod), and until its admission task
        ends only that task adds entries for the pod; a release during the admission cancels the task first, so no
        alloc record of the pod can follow its release record. Until `commit` the pod is also kept out of the
        checkpoint, so a rotation point between a change and its append is covered by the record, which lands in
        the newer segment."""
        self._dirty.set()
        return self._journal.append_all([alloc_record(allocation) for allocation in allocations], inline)

    def released(self, pod_uid: str) -> asyncio.Future[None]:
        self._dirty.set()
        return self._journal.append(release_record(pod_uid))

    def durable(self) -> asyncio.Future[None]:
        """Resolves once every change journaled so far is on disk."""
        return self._journal.barrier()

    # -- background checkpoint -----------------------------------------------------------------------------------------

    async def run_checkpoints(self) -> None:
        """The background checkpoint loop, until cancelled (the agent runs it supervised).

        A checkpoint that fails (its write, or the journal rotation under it: a full disk) is logged and raised,
        so the supervisor reports and counts it as this task failing (`/readyz`, the task restarts metric) and
        runs it again after its backoff; the journal still holds every record meanwhile, and the retry finds the
        state dirty."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.checkpoint_now()
            except Exception as err:
                self._dirty.set()
                log.error("background checkpoint failed; retried after the task's backoff: %s", err)
                raise
            await asyncio.sleep(max(MIN_CHECKPOINT_INTERVAL_SECONDS, self.last_checkpoint_seconds * CHECKPOINT_PACING))

    async def checkpoint_now(self) -> None:
        """Write a checkpoint covering every change so far, then drop the journal segments it covers: only those
        its own rotation closed, and none when that rotation failed (later records are then still in them)."""
        rotation = self._journal.rotate()
        await self._write_checkpoint()
        await rotation.switched  # raises the switch's error: then nothing is deleted
        await asyncio.to_thread(self._journal.delete_upto, rotation.covered)
        self.checkpoints += 1

    async def _write_checkpoint(self) -> None:
        """The checkpoint requested in the rotation's loop step; its duration paces the next one (waiting for
        the journal's switch is not the checkpoint's cost)."""
        started = time.monotonic()
        await self._checkpoint.request()
        self.last_checkpoint_seconds = time.monotonic() - started

    async def close(self) -> None:
        """After `run_checkpoints` is cancelled: a last checkpoint, then the journal is closed."""
        try:
            await self.checkpoint_now()
        except Exception as err:
            log.warning("final checkpoint failed: %s", err)
        await self._journal.close()


def journal_checksums(journal: Journal) -> Callable[[bytes], Awaitable[None]]:
    """The CheckpointWriter's `before_write`: before a checkpoint is renamed into place, its checksum goes durably
    into the journal (`checkpoint_record`), so a start can tell our checkpoint from one another process wrote after
    the journal. The journal's writer thread writes it: no admission waits for it, so the loop does not either. A
    closed journal (the agent stopping: every change is in this checkpoint already) or one never opened records
    nothing."""

    async def record(blob: bytes) -> None:
        if journal.is_open:
            await journal.append_off_loop(checkpoint_record(_blob_checksum(blob)))

    return record


def _blob_checksum(blob: bytes) -> int:
    """The `Checksum` of an encoded checkpoint (its last field: `...},"Checksum":<n>}`)."""
    return int(blob[blob.rindex(b'"Checksum":') + len(b'"Checksum":') : blob.rindex(b"}")])
