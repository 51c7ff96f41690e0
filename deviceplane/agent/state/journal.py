"""The allocation journal: what makes an admission durable in one small append + fdatasync (one pwritev with
RWF_DSYNC where the kernel has it, which syncs the data as fdatasync does, in the same call).

The kubelet rewrites its whole checkpoint after every allocation, O(pods) per admission. Here every change of
`PodDevices` is also appended, in the order it was applied, to a journal segment in a directory of its own beside
the checkpoint (`JOURNAL_DIRNAME`):

    <dir>/deviceplane_allocations.<seq>.journal     one record per line: "<crc32 hex> <json>\\n"

    {"op": "alloc", "pod": uid, "ctr": name, "res": resource, "numa": {"0": [ids], "-1": [ids]}, "resp": base64}
    {"op": "release", "pod": uid}

Records are idempotent (alloc sets one entry, release drops a pod), so replaying a segment over a checkpoint that
already contains part of it gives the same state. Appends are group-committed: every record buffered while one
fdatasync runs shares the next. Segments are pre-filled with zeros so an append never grows the file and
fdatasync has no metadata to flush. At replay, invalid lines after a segment's last valid record are its zero fill
or a write torn at a crash; invalid lines before it are corruption: logged as an error, counted, and skipped, the
records after them still applied (records are idempotent and each concerns one pod, so later ones still hold).

Rotation keeps the journal short: `rotate()` switches new records to a fresh segment at a point where the
in-memory state already reflects every record before it; once a kubelet-format checkpoint requested after that
point is durable and the switch is done, the older segments are deleted (see agent.durability). A switch that fails
(the new segment cannot be created: a full disk) fails that rotation, so nothing is deleted; records go on in the
segment still open, in order.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import json
import logging
import os
import queue
import re
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplane.agent.state.directories import fsync_directory, make_directory
from deviceplane.core.checkpoint import PodDevicesEntry
from deviceplane.core.durations import BucketedDurations
from deviceplane.core.pod_devices import Allocation, PodDevices, allocation_from_entry

log = logging.getLogger("deviceplane.journal")

# The journal's directory inside the device-plugin directory. Not the device-plugin directory itself: device plugins
# watch that one (inotify, non-recursive) for kubelet.sock, and a segment there woke every plugin on the node at each
# admission's write, on the CPU the write was waiting for the disk beside (benchmarks/README.md, "Journal directory").
JOURNAL_DIRNAME = "deviceplane-journal"
JOURNAL_DIR_MODE = 0o700
SEGMENT_PREFIX = "deviceplane_allocations."
SEGMENT_SUFFIX = ".journal"
SEGMENT_BYTES = 1 << 20
# One durable write: ~0.1-0.2 ms on a local SSD, milliseconds on network disks, seconds when the disk stalls.
SYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)" + re.escape(SEGMENT_SUFFIX))


def segment_path(directory: Path, seq: int) -> Path:
    return directory / f"{SEGMENT_PREFIX}{seq:012d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(directory):
            match = _SEGMENT_NAME.fullmatch(entry)
            if match:
                found.append((int(match.group(1)), directory / entry))
    return sorted(found)


def adopt_segments(source: Path, directory: Path) -> int:
    """Move the segments an earlier version journaled into `source` (the device-plugin directory) into `directory`,
    after any already there and in their own order, so the next replay applies them in the order they were written
    (an agent downgraded and upgraded again wrote those in `directory` first). Returns how many moved. Blocking.

    Each segment is renamed (same file system, atomic), and both directories are fsynced before the next start could
    need it: a crash midway leaves every segment in one of the two, and the next start moves the rest."""
    legacy = list_segments(source)
    if not legacy:
        return 0
    make_directory(directory, JOURNAL_DIR_MODE)
    present = list_segments(directory)
    after = present[-1][0] if present else 0
    for offset, (_seq, path) in enumerate(legacy, start=1):
        os.rename(path, segment_path(directory, after + offset))
    fsync_directory(directory)
    fsync_directory(source)
    log.info("journal segments moved into the journal directory", extra={"segments": len(legacy), "to": str(directory)})
    return len(legacy)


def alloc_record(allocation: Allocation) -> dict[str, Any]:
    return {
        "op": "alloc",
        "pod": allocation.pod_uid,
        "ctr": allocation.container,
        "res": allocation.resource,
        "numa": {str(numa): list(ids) for numa, ids in allocation.per_numa.items()},
        "resp": base64.b64encode(allocation.entry.AllocResp or b"").decode("ascii"),
    }


def release_record(pod_uid: str) -> dict[str, Any]:
    return {"op": "release", "pod": pod_uid}


def checkpoint_record(checkpoint_sum: int) -> dict[str, Any]:
    """Journaled (durably) just before the agent renames a checkpoint with this checksum into place: at start, a
    checkpoint whose checksum no such record names was written by someone else (a kubelet that took the directory
    over) after every record of the journal, which then must not be replayed over it."""
    return {"op": "checkpoint", "sum": checkpoint_sum}


# One encoder for every record: json.dumps with non-default arguments builds a new one per call (~1 us of each
# admission's ~3 us of encoding).
_RECORD_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


def encode_record(record: dict[str, Any]) -> bytes:
    body = _RECORD_ENCODER.encode(record).encode("ascii")
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse_line(line: bytes) -> dict[str, Any] | None:
    """The record a line holds, or None if it is not a valid one (checksum, JSON, shape)."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass(frozen=True, slots=True)
class SegmentRead:
    records: list[dict[str, Any]]
    # Invalid lines with a valid record after them: not a torn tail (an append only ever writes after the last
    # record), so damage in the middle of the segment. Their records are lost; the ones after them are kept.
    corrupt_lines: list[int]


def read_segment(path: Path) -> SegmentRead:
    """Valid records of a segment, in order. Invalid lines after the last valid record are the zero fill or a write
    torn at a crash and end the segment; invalid lines before it are corruption, reported and skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return SegmentRead([], [])
    parsed = [_parse_line(line) for line in data.split(b"\n")]
    last_valid = max((i for i, record in enumerate(parsed) if record is not None), default=-1)
    records = [record for record in parsed[: last_valid + 1] if record is not None]
    corrupt = [i + 1 for i, record in enumerate(parsed[:last_valid]) if record is None]
    return SegmentRead(records, corrupt)


def apply_record(pod_devices: PodDevices, record: dict[str, Any]) -> bool:
    """Replay one record; False for one that cannot be applied (ignored, as upstream skips bad entries)."""
    try:
        if record["op"] == "release":
            pod_devices.remove_pod(str(record["pod"]))
            return True
        if record["op"] == "checkpoint":
            return False  # a marker: changes nothing (see `checkpoint_record`)
        if record["op"] == "alloc":
            entry = PodDevicesEntry(
                PodUID=str(record["pod"]),
                ContainerName=str(record["ctr"]),
                ResourceName=str(record["res"]),
                DeviceIDs={int(numa): list(map(str, ids)) for numa, ids in record["numa"].items()},
                AllocResp=base64.b64decode(record["resp"]),
            )
            allocation = allocation_from_entry(entry)
            if allocation is None:
                log.warning("journal record skipped", extra={"error": "allocation response does not parse"})
                return False
            pod_devices.insert(allocation)
            return True
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        log.warning("journal record skipped", extra={"error": str(err)})
    return False


@dataclass(slots=True)
class _Pending:
    data: bytearray
    waiters: list[asyncio.Future[None]]
    # Set on the group a rotation starts: resolved once the journal has switched to the group's segment.
    rotation: asyncio.Future[None] | None = None


@dataclass(frozen=True, slots=True)
class Rotation:
    """A rotation point. `covered`: the last segment whose records all precede it. `switched` resolves once the
    journal writes to a newer segment (so `covered` and everything before it are closed), or fails with the error
    that kept the new segment from being created; then the records after the point are in `covered` too."""

    covered: int
    switched: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What writing one group did: the segment it switched to, the write's error, the rotation's error."""

    switched: int | None
    error: Exception | None
    rotation_error: Exception | None = None


_STOP = object()
_RWF_DSYNC: int = getattr(os, "RWF_DSYNC", 0)
# An inline write holds the event loop for one fdatasync; only while they stay this fast (typically 0.1-0.2 ms).
INLINE_SYNC_LIMIT_SECONDS = 0.002


class Journal:
    """Appends on the event loop (buffered, ordered), group-committed per loop step: the records appended in one
    step are written together when it ends (`call_soon`), on the loop thread itself while the disk is fast (the last
    fdatasync under `inline_sync_limit` seconds, typically 0.1-0.2 ms) and the writer thread is idle; else by a
    writer thread of the journal's own, where records buffered while one write runs share the next.

    On the loop, not in the thread, because a hand-off costs more than the write holds the loop: waking the writer,
    its GIL hand-backs and the `call_soon_threadsafe` that wakes the loop again were 5.6-6.9 context switches per
    admission with 8 in flight (against 1.6-2.1 now), and the concurrent rate's median over three alternated pairs
    went from 2,240 to 2,404/s (benchmarks/README.md). While the loop waits for the disk the other processes
    (plugins, clients) have the CPU, and what arrives meanwhile is handled in the next step as one batch, whose
    records again share one write. A slow disk sends the writes to the thread, so the loop is never held up by one
    for long.

    An append may also ask to be written `inline`: now, not at the step's end, which saves an admission alone in
    flight the extra loop step (nothing could share its write anyway).

    The writer thread is fed through a lock-protected queue, not `asyncio.to_thread` per group commit: that cost a
    task, an executor work item and two chained futures per write on the event loop. It hands each finished group
    back with one `call_soon_threadsafe`.
    """

    def __init__(
        self, directory: Path, segment_bytes: int = SEGMENT_BYTES, inline_sync_limit: float = INLINE_SYNC_LIMIT_SECONDS
    ) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._inline_sync_limit = inline_sync_limit
        self._seq = 0
        self._fd: int | None = None
        self._offset = 0
        # Buffered records per segment, in order; a rotation starts a new entry. Shared with the writer thread
        # (it pops entries), so only touched under `_lock`.
        self._queue: list[tuple[int, _Pending]] = []
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_idle = True  # under `_lock`: the writer waits for a wake-up
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed_upto = -1  # segments with a lower or equal seq are closed (fully written)
        # The next segment, zero-filled ahead of time so a rotation does not stall appends behind a 1 MB write.
        self._spare: tuple[int, int] | None = None
        self._spare_lock = threading.Lock()
        self._spare_task: asyncio.Task[None] | None = None
        self.syncs = 0
        self.inline_syncs = 0
        self._last_sync_seconds = 0.0
        self.sync_durations = BucketedDurations(SYNC_BUCKETS)  # every group write, wherever it ran
        self._dsync_writes = _RWF_DSYNC != 0
        self.corrupt_records = 0  # invalid records found in the middle of a segment at replay
        self._batch: _Pending | None = None  # records appended in this loop step, not yet committed
        # The highest segment a switch has claimed (under `_spare_lock`): a spare is never made at or below it, as
        # that would truncate (zero) a segment in use.
        self._claimed = 0

    # -- start ---------------------------------------------------------------------------------------------------------

    def replay(self, pod_devices: PodDevices, checkpoint_sum: int | None = None) -> int:
        """Apply every existing segment, oldest first; returns the number of records applied. Blocking.

        `checkpoint_sum`: the checksum of the checkpoint restored before (None: there was none). When the journal
        names checkpoints it wrote (`checkpoint_record`) and none of them is this one, the checkpoint was written by
        another process after the journal's last record (a kubelet that used the directory meanwhile): it is the
        newer state, and the journal's records, all older, are not replayed over it (they could give a device the
        kubelet has handed on to a second pod)."""
        applied = 0
        segments = list_segments(self.directory)
        reads = []
        for _seq, path in segments:
            read = read_segment(path)
            if read.corrupt_lines:
                self.corrupt_records += len(read.corrupt_lines)
                log.error(
                    "journal segment corrupt: records lost in the middle of it; the valid records after them are kept",
                    extra={"segment": str(path), "lines": read.corrupt_lines[:20], "count": len(read.corrupt_lines)},
                )
            reads.append(read)
        self._seq = segments[-1][0] if segments else 0
        records = [record for read in reads for record in read.records]
        marks = {record.get("sum") for record in records if record.get("op") == "checkpoint"}
        if checkpoint_sum is not None and marks and checkpoint_sum not in marks:
            changes = sum(1 for record in records if record.get("op") in ("alloc", "release"))
            log.warning(
                "journal older than the checkpoint (another process, a kubelet, wrote the checkpoint after it); "
                "its records are not replayed, and its segments are deleted",
                extra={"segments": len(segments), "records_ignored": changes, "checkpoint_checksum": checkpoint_sum},
            )
            # The decision must outlive this run: left in place, the same segments (whose marks still do not name
            # this checkpoint) would make the next start ignore the records this run journals before its own first
            # checkpoint too. The next segment's creation fsyncs the directory, so the removal is durable before
            # any record of this run is.
            for _seq, path in segments:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return 0
        for record in records:
            applied += apply_record(pod_devices, record)
        return applied

    def open(self) -> None:
        """Start a fresh segment after the replayed ones. Blocking."""
        self._seq += 1
        with self._spare_lock:
            self._claimed = self._seq
        self._fd = self._create_segment(self._seq)
        self._offset = 0
        self._closed_upto = self._seq - 1
        self._prepare_spare(self._seq + 1)

    def _create_segment(self, seq: int) -> int:
        make_directory(self.directory, JOURNAL_DIR_MODE)
        path = segment_path(self.directory, seq)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self._zero_fill(fd)
        except BaseException:
            # A full disk: the partial file would hold the space that is missing, and its fd would leak.
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        return fd

    def _zero_fill(self, fd: int) -> None:
        # Real zeros, not fallocate: unwritten extents would make every fdatasync flush metadata.
        chunk = memoryview(bytes(min(self.segment_bytes, 1 << 20)))
        for _ in range(max(1, self.segment_bytes // len(chunk))):
            view = chunk
            while view:  # a nearly full disk writes short before it fails: the segment must be whole
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        fsync_directory(self.directory)

    # -- appends -------------------------------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    @property
    def segment(self) -> int:
        """The segment new records go to."""
        with self._lock:
            return self._segment()

    def _segment(self) -> int:
        return self._queue[-1][0] if self._queue else self._seq

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Buffer a record (in call order) and return a future resolved once it is durable."""
        return self.append_all([record])

    def append_all(self, records: Sequence[dict[str, Any]], inline: bool = False) -> asyncio.Future[None]:
        """Buffer records (in call order) and return a future resolved once all are durable; `inline`: write them
        now, not at the end of this loop step, if the writer is idle (see the class docstring)."""
        data = b"".join(encode_record(record) for record in records)
        loop = self._loop
        if loop is None:  # found once: get_running_loop() may cost a getpid() syscall (see AdmissionRunner)
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if inline and self._inline_allowed():
                group = _Pending(bytearray(data), [future])
                seq = self._seq
            else:
                if self._batch is None:  # the step's first append: commit the step's records once it ends
                    self._batch = _Pending(bytearray(), [])
                    loop.call_soon(self._commit_batch)
                self._batch.data += data
                self._batch.waiters.append(future)
                return future
        self._write_on_loop(seq, group)
        return future

    def append_off_loop(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Buffer a record after every one appended so far, to be written by the writer thread, never on the loop:
        for a record no admission waits for (a checkpoint's mark), whose fdatasync would otherwise hold the loop while
        the checkpoint's own write keeps the disk busy (0.3-0.5 ms measured, right when a plugin's first devices
        arrive). Resolved once it is durable."""
        return self._to_writer(encode_record(record))

    def _commit_batch(self) -> None:
        """The loop step that appended the batch has ended: write it here and now if the writer is idle and the
        disk fast, else hand it to the writer thread."""
        with self._lock:
            batch, self._batch = self._batch, None
            if batch is None:
                return
            if not self._inline_allowed():
                self._enqueue(batch)
                self._kick()
                return
            seq = self._seq
        self._write_on_loop(seq, batch)

    def _write_on_loop(self, seq: int, group: _Pending) -> None:
        # The writer is idle and only this (the loop's) thread wakes it, so it cannot start a write meanwhile.
        outcome = self._write_group(seq, group)
        self.inline_syncs += 1
        self._settle(outcome, group)

    def _move_batch(self) -> None:
        """Under `_lock`: the batch joins the writer's queue now (a barrier or rotation must come after it)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            self._enqueue(batch)

    def _enqueue(self, pending: _Pending) -> None:
        """Under `_lock`: `pending`'s records and waiters join the writer's queue, after everything in it."""
        tail = self._tail()
        tail.data += pending.data
        tail.waiters.extend(pending.waiters)

    def _inline_allowed(self) -> bool:
        """Under `_lock`: nothing queued, the writer waiting, the disk fast and the journal open."""
        return (
            self._batch is None
            and not self._queue
            and (self._writer is None or self._writer_idle)
            and self._last_sync_seconds < self._inline_sync_limit
            and self._fd is not None
        )

    def barrier(self) -> asyncio.Future[None]:
        """A future resolved once every record appended before this call is durable (appends nothing)."""
        return self._to_writer(b"")

    def _to_writer(self, data: bytes) -> asyncio.Future[None]:
        """`data` queued for the writer thread after every record appended so far (this step's batch included); the
        future resolves once all of them are durable."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._move_batch()
            tail = self._tail()
            tail.data += data
            tail.waiters.append(future)
            self._kick()
        return future

    def _tail(self) -> _Pending:
        """The buffer new records join (the current segment's). Under `_lock`."""
        seq = self._segment()
        if not self._queue or self._queue[-1][0] != seq:
            self._queue.append((seq, _Pending(bytearray(), [])))
        return self._queue[-1][1]

    def rotate(self) -> Rotation:
        """Send later records to a new segment (see `Rotation`)."""
        switched: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._move_batch()
            current = self._segment()
            self._queue.append((current + 1, _Pending(bytearray(), [], switched)))
            self._kick()
        return Rotation(current, switched)

    def delete_upto(self, seq: int) -> None:
        """Remove closed segments <= seq (a durable checkpoint covers them). Blocking."""
        for number, path in list_segments(self.directory):
            if number <= min(seq, self._closed_upto):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    # -- the writer thread ---------------------------------------------------------------------------------------------

    def _kick(self) -> None:
        """Wake the writer if it waits (under `_lock`, so a wake-up is never lost). Starts it on first use."""
        if self._writer is None:
            self._loop = asyncio.get_running_loop()
            self._writer = threading.Thread(target=self._write_loop, name="journal-writer", daemon=True)
            self._writer.start()
        if self._writer_idle and self._queue:
            self._writer_idle = False
            self._wake.put(None)

    def _write_loop(self) -> None:
        while self._wake.get() is not _STOP:
            while True:
                with self._lock:
                    if not self._queue:
                        self._writer_idle = True
                        break
                    seq, pending = self._queue.pop(0)
                self._write_pending(seq, pending)

    def _write_pending(self, seq: int, pending: _Pending) -> None:
        outcome = self._write_group(seq, pending)
        self._call_loop(self._settle, outcome, pending)

    def _write_group(self, seq: int, pending: _Pending) -> _Outcome:
        """Write and fdatasync one group (the writer thread, or an inline append)."""
        switched = None
        switch_error: Exception | None = None
        error: Exception | None = None
        try:
            # Only ever forward: records buffered for a segment that a write filled meanwhile (`_write` moved on)
            # belong in the newer segment; going back would re-create (truncate) the full one.
            if seq > self._seq:
                switch_error = self._try_switch(seq)
                switched = None if switch_error else seq
            if pending.data:
                self._write(bytes(pending.data))
                self.syncs += 1
        except OSError as err:
            error = err
        except Exception as err:  # a bug: the writer thread must live on, and this group's waiters hear of it
            log.exception("journal writer failed")
            error = err
        # A rotation holds once the journal writes past `seq - 1`, whichever switch got it there.
        rotation_error = None if self._seq >= seq else (switch_error or error or OSError("journal did not switch"))
        return _Outcome(switched, error, rotation_error)

    def _try_switch(self, seq: int) -> Exception | None:
        """Switch to segment `seq`; on failure stay in the current one (still open, every record before this
        group in it, so this group's records still go after them) and return the error for the rotation."""
        try:
            self._switch(seq)
        except OSError as err:
            log.error(
                "journal segment switch failed; records go on in the current segment",
                extra={"segment": str(segment_path(self.directory, seq)), "error": str(err)},
            )
            return err
        return None

    def _call_loop(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(callback, *args)

    def _settle(self, outcome: _Outcome, pending: _Pending) -> None:
        """On the loop: a group is written (or failed)."""
        if outcome.switched is not None:
            self._spare_task = asyncio.create_task(asyncio.to_thread(self._prepare_spare_or_log, outcome.switched + 1))
        if outcome.error is not None:
            log.error("journal write failed: %s", outcome.error)
        for waiter in pending.waiters:
            _resolve(waiter, outcome.error)
        if pending.rotation is not None:
            _resolve(pending.rotation, outcome.rotation_error)

    def _prepare_spare_or_log(self, seq: int) -> None:
        """A spare that cannot be made now is created when it is needed (and that switch reports its error)."""
        try:
            self._prepare_spare(seq)
        except OSError as err:
            log.warning(
                "journal spare segment not prepared",
                extra={"segment": str(segment_path(self.directory, seq)), "error": str(err)},
            )

    def _prepare_spare(self, seq: int) -> None:
        with self._spare_lock:
            if seq <= self._claimed:
                # Late (a switch got there first and created that segment itself): making it now would truncate
                # the segment in use, and replacing it later would unlink it.
                return
            if self._spare is None or self._spare[0] < seq:
                if self._spare is not None:
                    old, self._spare = self._spare, None
                    os.close(old[1])
                    with contextlib.suppress(FileNotFoundError):
                        segment_path(self.directory, old[0]).unlink()
                self._spare = (seq, self._create_segment(seq))

    def _take_segment(self, seq: int) -> int:
        with self._spare_lock:  # held while creating, so a late spare of `seq` cannot truncate it meanwhile
            self._claimed = max(self._claimed, seq)
            if self._spare is not None and self._spare[0] == seq:
                fd = self._spare[1]
                self._spare = None
                return fd
            return self._create_segment(seq)

    def _switch(self, seq: int) -> None:
        fd = self._take_segment(seq)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        self._closed_upto = seq - 1
        self._seq = seq
        self._offset = 0

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            raise OSError("journal is not open")
        if self._offset + len(data) > self.segment_bytes:
            # Full: continue in the next segment. Its records are still ordered after this one's.
            self._switch(self._seq + 1)
        view = memoryview(data)
        started = time.perf_counter()
        while view:
            written = self._durable_write(view)
            self._offset += written
            view = view[written:]
        if not self._dsync_writes:
            os.fdatasync(self._fd)
        self._last_sync_seconds = elapsed = time.perf_counter() - started
        self.sync_durations.observe(elapsed)

    def _durable_write(self, view: memoryview) -> int:
        """pwrite, durable on return where the kernel can (RWF_DSYNC: the data synced as by fdatasync, in the same
        call: one system call, and for the writer thread one GIL hand-back less per group, which under load waits
        for the event loop's switch interval); else a plain pwrite, synced by the caller."""
        assert self._fd is not None
        if self._dsync_writes:
            try:
                return os.pwritev(self._fd, [view], self._offset, _RWF_DSYNC)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._dsync_writes = False  # an old kernel or a filesystem without it: fdatasync after each write
        return os.pwrite(self._fd, view, self._offset)

    async def close(self) -> None:
        """Write what is buffered, stop the writer thread, close the segment."""
        self._commit_batch()
        writer = self._writer
        if writer is not None:
            self._wake.put(_STOP)  # after any wake-up already queued: the writer drains the queue first
            # Its last `_settle` callbacks were handed to the loop before this join's completion is.
            await asyncio.to_thread(writer.join)
            self._writer = None
        with self._lock:
            left, self._queue = self._queue, []  # appended while closing: never written
        closed = OSError("journal closed")
        for _seq, pending in left:
            self._settle(_Outcome(None, closed, closed), pending)
        if self._spare_task is not None:
            await asyncio.gather(self._spare_task, return_exceptions=True)
        with self._spare_lock:
            if self._spare is not None:
                # An unused spare holds no records; removing it keeps the directory tidy.
                os.close(self._spare[1])
                with contextlib.suppress(FileNotFoundError):
                    segment_path(self.directory, self._spare[0]).unlink()
                self._spare = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _resolve(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # retrieved: a future nobody awaits does not log "never retrieved"
