"""The allocation journal on real files: replay, torn tails, rotation and idempotence."""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from deviceplane.agent.state.journal import (
    Journal,
    alloc_record,
    checkpoint_record,
    list_segments,
    read_segment,
    release_record,
)
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.pod_devices import Allocation, PodDevices, make_allocation


def alloc(pod: str, device: str, numa: int = 0) -> Allocation:
    return make_allocation(
        pod, "c", "example.com/r", {numa: (device,)}, pb.ContainerAllocateResponse(envs={"D": device})
    )


def state(pds: PodDevices) -> dict[str, set[str]]:
    return {uid: pds.pod_devices(uid, "example.com/r") for uid in sorted(pds.pods())}


def replayed(directory: Path, base: PodDevices | None = None) -> PodDevices:
    pds = base or PodDevices()
    Journal(directory).replay(pds)
    return pds


async def test_replay_restores_allocations_and_releases(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    journal.append(alloc_record(alloc("p1", "d1")))
    journal.append(alloc_record(alloc("p2", "d2", numa=-1)))
    await journal.append(release_record("p1"))
    await journal.close()
    pds = replayed(tmp_path)
    assert state(pds) == {"p2": {"d2"}}
    options = pds.run_options("p2", "c")
    assert options is not None and options.envs == {"D": "d2"}
    assert pds.container_allocations("p2", "c")["example.com/r"].per_numa == {-1: ("d2",)}
    # replaying again over the result changes nothing (records are idempotent)
    assert state(replayed(tmp_path, pds)) == {"p2": {"d2"}}


async def test_torn_tail_ends_the_segment(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    await journal.append(alloc_record(alloc("p1", "d1")))
    await journal.close()
    (_seq, path), *_ = list_segments(tmp_path)
    data = bytearray(path.read_bytes())
    end = data.index(b"\n") + 1
    torn = b'0badc0de {"op":"alloc","pod":"p9"'  # a crash mid-append: no newline, wrong checksum
    data[end : end + len(torn)] = torn
    path.write_bytes(bytes(data))
    assert state(replayed(tmp_path)) == {"p1": {"d1"}}


async def test_rotation_keeps_later_records_and_drops_covered_segments(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    await journal.append(alloc_record(alloc("p1", "d1")))
    rotation = journal.rotate()
    covered = rotation.covered
    await journal.append(alloc_record(alloc("p2", "d2")))
    await rotation.switched
    journal.delete_upto(covered)
    await journal.close()
    assert all(seq > covered for seq, _ in list_segments(tmp_path))
    # the checkpoint written after the rotation holds p1; the journal adds p2 on top of it
    checkpoint = PodDevices()
    checkpoint.insert(alloc("p1", "d1"))
    assert state(replayed(tmp_path, checkpoint)) == {"p1": {"d1"}, "p2": {"d2"}}


async def test_full_segment_continues_in_the_next(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_bytes=4 << 10)
    journal.replay(PodDevices())
    journal.open()
    for i in range(100):  # ~115 bytes each, one fdatasync each: three 4 KiB segments
        await journal.append(alloc_record(alloc(f"p{i}", f"d{i}")))
    await journal.append(release_record("p0"))
    await journal.close()
    assert len(list_segments(tmp_path)) > 2
    pds = replayed(tmp_path)
    assert len(pds.pods()) == 99 and not pds.has_pod("p0")


async def test_record_with_undecodable_response_is_skipped(tmp_path: Path) -> None:
    # A checksum-valid record whose response bytes are not a ContainerAllocateResponse is skipped, as upstream skips
    # such checkpoint entries; the records after it still apply and the agent still starts.
    journal = Journal(tmp_path, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    bad = alloc_record(alloc("p1", "d1"))
    bad["resp"] = base64.b64encode(b"\xff\xff").decode("ascii")
    journal.append(bad)
    await journal.append(alloc_record(alloc("p2", "d2")))
    await journal.close()
    pds = PodDevices()
    assert Journal(tmp_path).replay(pds) == 1
    assert state(pds) == {"p2": {"d2"}}


async def test_records_queued_while_a_full_segment_switches_are_kept(tmp_path: Path) -> None:
    """Eight concurrent writers (as 8 concurrent admissions) over 4 KiB segments: segments fill while records are
    buffered, and every acknowledged record, in order, is still there at replay."""
    journal = Journal(tmp_path, segment_bytes=4 << 10)
    journal.replay(PodDevices())
    journal.open()

    async def writer(w: int) -> None:
        for i in range(150):
            await journal.append(alloc_record(alloc(f"w{w}-{i}", f"d{w}-{i}")))
            if i % 3 == 0:
                await journal.append(release_record(f"w{w}-{i}"))

    await asyncio.gather(*(writer(w) for w in range(8)))
    await journal.close()
    expected = {f"w{w}-{i}": {f"d{w}-{i}"} for w in range(8) for i in range(150) if i % 3}
    assert state(replayed(tmp_path)) == dict(sorted(expected.items()))


class GatedJournal(Journal):
    """Holds each write until `gate` is set: an append can then be buffered while the write that fills the segment
    is in flight (as with concurrent admissions, where it happened when the worker thread started late). Every
    write goes to the writer thread, as on a disk too slow to hold the event loop for (inline_sync_limit=0)."""

    def __init__(self, directory: Path, segment_bytes: int) -> None:
        super().__init__(directory, segment_bytes, inline_sync_limit=0.0)
        self.gate = threading.Event()
        self.gate.set()

    def _write(self, data: bytes) -> None:
        self.gate.wait(10)
        super()._write(data)


async def test_record_buffered_while_the_segment_fills_never_truncates_it(tmp_path: Path) -> None:
    """Found profiling 8 concurrent admissions: a record buffered for the segment that the in-flight write filled
    made the flusher switch back to that older segment, re-creating (truncating) it: durable records were lost, and
    the checkpoint pacer's wait for the rotated segment spun on the event loop."""
    journal = GatedJournal(tmp_path, segment_bytes=4 << 10)
    journal.replay(PodDevices())
    journal.open()
    for i in range(30):  # ~115 bytes each: most of the first 4 KiB segment
        await journal.append(alloc_record(alloc(f"p{i}", f"d{i}")))
    journal.gate.clear()
    filling = [journal.append(alloc_record(alloc(f"q{i}", f"e{i}"))) for i in range(10)]  # overflows: next segment
    await asyncio.sleep(0.05)  # the flusher is now waiting in its worker thread
    late = journal.append(alloc_record(alloc("late", "d-late")))  # buffered for the segment being filled
    journal.gate.set()
    await asyncio.gather(*filling, late)
    rotation = journal.rotate()
    await asyncio.wait_for(rotation.switched, 5)
    await journal.close()
    pods = replayed(tmp_path).pods()
    assert {f"p{i}" for i in range(30)} | {f"q{i}" for i in range(10)} | {"late"} <= set(pods)


class FaultyJournal(Journal):
    """A bug in the write path (a fault no real file produces, hence this subclass): the first write raises."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.failures = 1

    def _write(self, data: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("injected bug")
        super()._write(data)


async def test_a_bug_in_the_writer_fails_its_group_and_the_writer_lives_on(tmp_path: Path) -> None:
    journal = FaultyJournal(tmp_path)
    journal.replay(PodDevices())
    journal.open()
    failed = journal.append(alloc_record(alloc("p0", "d0")))
    try:
        await asyncio.wait_for(failed, 5)
    except RuntimeError as err:
        assert str(err) == "injected bug"
    else:
        raise AssertionError("the failed write's waiter was told nothing")
    await asyncio.wait_for(journal.append(alloc_record(alloc("p1", "d1"))), 5)  # the writer thread is still there
    await journal.close()
    assert set(replayed(tmp_path).pods()) == {"p1"}


class HeldJournal(Journal):
    """Records which thread wrote each group; a write on the writer thread is held until told, and the next write on
    the loop takes `slow_seconds` (a busy writer and a slow fdatasync, made deterministic: this subclass)."""

    def __init__(self, directory: Path, inline_sync_limit: float = 0.002) -> None:
        super().__init__(directory, inline_sync_limit=inline_sync_limit)
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.writes_on: list[str] = []
        self.slow_seconds = 0.0

    def _write(self, data: bytes) -> None:
        self.writes_on.append(threading.current_thread().name)
        if threading.current_thread().name == "journal-writer" and not self.go_on.is_set():
            self.entered.set()
            self.go_on.wait(10)
        super()._write(data)

    def _durable_write(self, view: memoryview) -> int:
        if self.slow_seconds and threading.current_thread() is threading.main_thread():
            time.sleep(self.slow_seconds)  # inside the timed write: it counts as the disk's
            self.slow_seconds = 0.0
        return super()._durable_write(view)


def open_journal(journal: Journal) -> Journal:
    journal.replay(PodDevices())
    journal.open()
    return journal


# The tests of writes on the loop raise the disk-speed limit: a busy CI disk can take over the 2 ms default for one
# fdatasync, which (as designed) sends the next write to the writer thread, held here until told.
ON_THE_LOOP = 60.0


async def test_inline_append_is_durable_before_it_returns_when_the_writer_is_idle(tmp_path: Path) -> None:
    journal = open_journal(HeldJournal(tmp_path, inline_sync_limit=ON_THE_LOOP))
    done = journal.append_all([alloc_record(alloc("p1", "d1")), alloc_record(alloc("p2", "d2"))], inline=True)
    # Written and fdatasync'd on this thread, both records in one write, before append_all returned.
    assert done.done() and done.exception() is None
    assert (journal.inline_syncs, journal.syncs, journal.writes_on) == (1, 1, ["MainThread"])
    assert state(replayed(tmp_path)) == {"p1": {"d1"}, "p2": {"d2"}}
    await journal.close()


async def test_appends_of_one_loop_step_share_one_write_on_the_loop_when_it_ends(tmp_path: Path) -> None:
    journal = open_journal(HeldJournal(tmp_path, inline_sync_limit=ON_THE_LOOP))
    first = journal.append(alloc_record(alloc("p1", "d1")))
    second = journal.append_all([alloc_record(alloc("p2", "d2")), alloc_record(alloc("p3", "d3"))])
    third = journal.append(release_record("p1"))
    assert not (first.done() or second.done() or third.done()) and journal.syncs == 0  # at the step's end
    await asyncio.wait_for(asyncio.gather(first, second, third), 10)
    assert (journal.syncs, journal.inline_syncs, journal.writes_on) == (1, 1, ["MainThread"])
    # An inline append after a step's appends, in the same step, waits its turn: order is kept.
    fourth = journal.append(alloc_record(alloc("p4", "d4")))
    fifth = journal.append_all([release_record("p4")], inline=True)
    assert not fifth.done()
    await asyncio.wait_for(asyncio.gather(fourth, fifth), 10)
    assert journal.syncs == 2
    await journal.close()
    assert state(replayed(tmp_path)) == {"p2": {"d2"}, "p3": {"d3"}}


async def test_after_a_slow_write_appends_go_to_the_writer_thread_and_keep_their_order(tmp_path: Path) -> None:
    journal = open_journal(HeldJournal(tmp_path, inline_sync_limit=0.05))
    journal.slow_seconds = 0.06
    await journal.append_all([alloc_record(alloc("p1", "d1"))], inline=True)  # on the loop, but too slow
    queued = journal.append(release_record("p1"))
    await asyncio.to_thread(journal.entered.wait, 10)  # the step ended: the batch went to the (held) writer
    behind = journal.append_all([alloc_record(alloc("p1", "d9"))], inline=True)
    later = journal.append(alloc_record(alloc("p2", "d2")))
    await asyncio.sleep(0.05)
    assert not (queued.done() or behind.done() or later.done())  # behind the writer's group, not around it
    journal.go_on.set()
    await asyncio.wait_for(asyncio.gather(queued, behind, later), 10)
    assert journal.writes_on == ["MainThread", "journal-writer", "journal-writer"]
    # The writer's fast writes bring the appends back to the loop (once the writer thread has gone idle).
    for _ in range(100):
        await journal.append(release_record("p2"))
        if journal.writes_on[-1] == "MainThread":
            break
    assert journal.writes_on[-1] == "MainThread"
    await journal.close()
    assert state(replayed(tmp_path)) == {"p1": {"d9"}}


async def test_an_off_loop_append_is_written_by_the_writer_thread_after_the_steps_appends(tmp_path: Path) -> None:
    """A checkpoint's mark: never written on the loop, even with the writer idle and the disk fast; the records this
    step appended before it come first, and records appended after it wait for it."""
    journal = open_journal(HeldJournal(tmp_path, inline_sync_limit=ON_THE_LOOP))
    before = journal.append(alloc_record(alloc("p1", "d1")))
    mark = journal.append_off_loop(checkpoint_record(7))
    await asyncio.to_thread(journal.entered.wait, 10)  # the writer holds both, in one group
    after = journal.append_all([release_record("p1")], inline=True)
    await asyncio.sleep(0.05)
    assert not (before.done() or mark.done() or after.done())  # `after` waits its turn behind the writer
    journal.go_on.set()
    await asyncio.wait_for(asyncio.gather(before, mark, after), 10)
    assert journal.writes_on[:2] == ["journal-writer", "journal-writer"] and journal.inline_syncs == 0
    await journal.close()
    records = [record for _seq, path in list_segments(tmp_path) for record in read_segment(path).records]
    assert [record["op"] for record in records] == ["alloc", "checkpoint", "release"]


async def test_rotation_and_close_come_after_the_appends_of_their_step(tmp_path: Path) -> None:
    journal = open_journal(Journal(tmp_path))
    before = journal.append(alloc_record(alloc("p1", "d1")))
    rotation = journal.rotate()  # p1's record belongs to the segments the rotation covers
    covered = rotation.covered
    after = journal.append(alloc_record(alloc("p2", "d2")))
    await asyncio.wait_for(asyncio.gather(before, after, rotation.switched), 10)
    segments = list_segments(tmp_path)
    assert [r["pod"] for seq, path in segments if seq <= covered for r in read_segment(path).records] == ["p1"]
    assert [r["pod"] for seq, path in segments if seq > covered for r in read_segment(path).records] == ["p2"]
    pending = journal.append(release_record("p2"))  # still in this step's batch when close() starts
    await journal.close()
    assert pending.done() and pending.exception() is None
    assert state(replayed(tmp_path)) == {"p1": {"d1"}}


async def test_close_writes_the_steps_batch_before_closing(tmp_path: Path) -> None:
    """No writer thread ever started (every write was on the loop), so close() awaits nothing before closing the
    segment: the batch must be written by close() itself, not by its step-end callback after the file is closed."""
    journal = open_journal(Journal(tmp_path))
    await journal.append(alloc_record(alloc("p1", "d1")))
    pending = journal.append(alloc_record(alloc("p2", "d2")))
    await journal.close()
    assert pending.done() and pending.exception() is None
    assert state(replayed(tmp_path)) == {"p1": {"d1"}, "p2": {"d2"}}


async def test_a_slow_disk_sends_inline_appends_to_the_writer_thread(tmp_path: Path) -> None:
    journal = Journal(tmp_path, inline_sync_limit=0.0)  # every fdatasync counts as too slow to hold the loop for
    journal.replay(PodDevices())
    journal.open()
    done = journal.append_all([alloc_record(alloc("p1", "d1"))], inline=True)
    assert not done.done()
    await asyncio.wait_for(done, 10)
    assert (journal.inline_syncs, journal.syncs) == (0, 1)
    await journal.close()
    assert state(replayed(tmp_path)) == {"p1": {"d1"}}


async def test_without_rwf_dsync_writes_are_followed_by_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel or filesystem refusing RWF_DSYNC (a fault this machine's ext4 cannot produce, hence the patch): the
    journal falls back to pwrite + fdatasync, once and for all, and loses nothing."""
    refused: list[int] = []
    real_pwritev = os.pwritev

    def pwritev(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if flags:
            refused.append(flags)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_pwritev(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "pwritev", pwritev)
    syncs: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (syncs.append(fd), real_fdatasync(fd))[1])
    journal = Journal(tmp_path)
    journal.replay(PodDevices())
    journal.open()
    await journal.append(alloc_record(alloc("p1", "d1")))
    await journal.append_all([alloc_record(alloc("p2", "d2"))], inline=True)
    await journal.close()
    assert len(refused) == 1 and len(syncs) == 2  # refused once; each write then synced by fdatasync
    assert state(replayed(tmp_path)) == {"p1": {"d1"}, "p2": {"d2"}}
