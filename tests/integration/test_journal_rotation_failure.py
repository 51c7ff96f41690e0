"""The background checkpoint's journal rotation when the next segment cannot be created.

Real cause: a nearly full disk. A segment is written full of zeros up front (journal._create_segment), the
checkpoint is a few KB, so with less free space than a segment the checkpoint is written while the rotation's
segment switch fails. Before the fix the failed switch was dropped silently: the checkpoint pacer waited forever for
the old segment to close (/readyz still ok), records went on into that segment, and once it filled and closed, the
stuck checkpoint deleted it, records newer than the checkpoint included: a crash then lost allocations reported
durable.

What must hold (docs/agent.md, Durability): every allocation reported durable survives a crash; a failed rotation
fails its checkpoint (nothing deleted) instead of hanging it; the pacer reports the failure and tries again.

The faults are real: a full tmpfs (ENOSPC, root only) and a directory standing where the next segment goes
(EISDIR, the same failure of `os.open` at any privilege).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.durability import AllocationStore, CheckpointContent
from deviceplane.agent.state.journal import JOURNAL_DIRNAME, Journal, alloc_record, list_segments, segment_path
from deviceplane.core.checkpoint import CheckpointEncoder, PodDevicesEntry
from deviceplane.core.pod_devices import Allocation, PodDevices, allocation_from_entry
from deviceplane.core.registry import DeviceRegistry
from tests.integration.conftest import short_tmp  # noqa: F401
from tests.support.alloc_env import alloc_env
from tests.support.pods import devices_of, simple_pod, wait_settled
from tests.support.procs import AgentProcess, wait_for

RES = "example.com/r"


def allocation(pod: str) -> Allocation:
    entry = PodDevicesEntry(
        PodUID=pod, ContainerName="c", ResourceName=RES, DeviceIDs={-1: [f"dev-{pod}"]}, AllocResp=b""
    )
    result = allocation_from_entry(entry)
    assert result is not None
    return result


class Durable:
    """The agent's durable state, in-process: the real Journal, AllocationStore, CheckpointWriter and
    CheckpointStore on a directory; small segments so that a few records fill one."""

    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.pod_devices = PodDevices()
        content = CheckpointContent(DeviceRegistry(300), self.pod_devices)
        checkpoint_file = CheckpointStore(directory)
        writer = CheckpointWriter(checkpoint_file.write_encoded, content.snapshot, CheckpointEncoder())
        self.journal = Journal(directory, segment_bytes=segment_bytes)
        self.store = AllocationStore(self.pod_devices, self.journal, content, writer)
        self.store.restore(checkpoint_file.read())

    async def admit(self, pod: str) -> None:
        """As an admission: applied in memory, then reported once its record is durable."""
        admitted = allocation(pod)
        self.pod_devices.insert(admitted)
        await self.store.allocated([admitted])

    def reported(self) -> set[str]:
        return set(self.pod_devices.pods())

    async def spare_settled(self) -> None:
        """The background preparation of the next segment has finished (succeeded or failed)."""
        if self.journal._spare_task is not None:
            await asyncio.gather(self.journal._spare_task, return_exceptions=True)


def readyz(agent: AgentProcess) -> str:
    try:
        return agent.get_text("/readyz")
    except urllib.error.HTTPError as err:
        return str(err.read().decode())


def after_crash(directory: Path) -> set[str]:
    """What a restart after SIGKILL restores: the checkpoint, then every journal segment left (read only)."""
    restored = PodDevices()
    data = CheckpointStore(directory).read()
    if data is not None and data.PodDeviceEntries:
        restored.load(data.PodDeviceEntries)
    Journal(directory).replay(restored)
    return set(restored.pods())


async def test_a_rotation_that_cannot_create_its_segment_fails_and_deletes_nothing(tmp_path: Path) -> None:
    """EISDIR at the next segment's path. The failed checkpoint ends at once with the error; the records after it
    stay in the open segment, which is kept even once it fills and closes; a later checkpoint deletes it."""
    durable = Durable(tmp_path, segment_bytes=4096)  # segment 1 open, spare 2 ready
    await durable.store.checkpoint_now()  # 1 -> 2 (the spare); spare 3 prepared
    await durable.spare_settled()
    blocker = segment_path(tmp_path, 4)
    blocker.mkdir()
    await durable.store.checkpoint_now()  # 2 -> 3 (the spare); preparing spare 4 fails
    await durable.spare_settled()
    await durable.admit("before")

    failing = asyncio.create_task(durable.store.checkpoint_now())  # 3 -> 4 cannot be created
    for i in range(5):
        await durable.admit(f"after-{i}")  # reported durable while the checkpoint is in trouble
    blocker.rmdir()  # space is back: the next switch (a full segment) succeeds
    for i in range(5, 80):
        await durable.admit(f"after-{i}")  # segment 3 fills; the journal goes on in 4
    outcome = (await asyncio.gather(asyncio.wait_for(failing, 5), return_exceptions=True))[0]

    lost = sorted(durable.reported() - after_crash(tmp_path))
    assert not lost, f"{len(lost)} allocations reported durable are gone after a crash: {lost[:5]}"
    assert isinstance(outcome, IsADirectoryError), f"the checkpoint over a failed rotation ended with {outcome!r}"

    await durable.store.checkpoint_now()  # a checkpoint whose rotation works deletes what it covers
    assert after_crash(tmp_path) == durable.reported()
    assert min(seq for seq, _ in list_segments(tmp_path)) > 3
    await durable.journal.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real filesystem that runs out of space. Needs root (mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mountpoint
    finally:
        # Lazily if a failed test left a file open: never leave the mount behind.
        if subprocess.run(["umount", str(mountpoint)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill the filesystem, then give back `leave` bytes."""
    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(64 << 10))
    except OSError as err:
        assert err.errno == errno.ENOSPC
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    os.close(fd)
    return ballast


async def test_a_full_disk_fails_the_rotation_and_keeps_every_durable_allocation(small_disk: Path) -> None:
    """ENOSPC: 16 KiB left, segments of 64 KiB. Preparing the spare fails and leaves no partial segment (it would
    hold the space that is missing); the rotation fails with ENOSPC; every record reported durable survives a crash.
    The journal alone, as the AllocationStore drives it: a checkpoint written meanwhile could lose the race for the
    last free pages against the failing zero fill, which is real but not what this test is about."""
    pod_devices = PodDevices()
    journal = Journal(small_disk, segment_bytes=64 << 10)
    journal.replay(pod_devices)
    journal.open()  # segment 1 and spare 2
    fill(small_disk, leave=16 << 10)
    first = journal.rotate()  # 1 -> 2 (the spare); spare 3 runs out of space
    await asyncio.wait_for(first.switched, 5)
    if journal._spare_task is not None:
        await journal._spare_task
    assert not segment_path(small_disk, 3).exists(), "a partial segment holds the space that is missing"

    reported = []
    for i in range(5):
        await journal.append(alloc_record(allocation(f"p{i}")))
        reported.append(f"p{i}")
    second = journal.rotate()  # 2 -> 3 runs out of space
    with pytest.raises(OSError) as failed:
        await asyncio.wait_for(second.switched, 5)
    assert failed.value.errno == errno.ENOSPC, repr(failed.value)
    for i in range(5, 10):
        await journal.append(alloc_record(allocation(f"p{i}")))  # still written: in segment 2, after the others
        reported.append(f"p{i}")
    assert after_crash(small_disk) == set(reported)
    await journal.close()


def test_agent_reports_a_failing_checkpoint_and_loses_nothing_at_sigkill(short_tmp: Path) -> None:  # noqa: F811
    """A real agent whose next journal segment cannot be created (EISDIR; a full disk in production): the
    checkpoint-pacer task fails (logged, counted in deviceplane_agent_task_restarts_total, named by /readyz while it
    waits to retry) instead of hanging unseen; pods admitted meanwhile survive SIGKILL."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        env.sim(RES, 8)
        agent = env.agent
        assert agent is not None
        journal_dir = env.plugin_dir / JOURNAL_DIRNAME
        highest = max(seq for seq, _ in list_segments(journal_dir))  # the spare, made at start
        for seq in range(highest + 1, highest + 4):  # the segments any rotation from now on would need
            segment_path(journal_dir, seq).mkdir()
        admitted: dict[str, set[str]] = {}

        def pacer_failed() -> bool:
            return (agent.metric("deviceplane_agent_task_restarts_total", task="checkpoint-pacer") or 0) >= 1

        # Each pod makes the state dirty, so the pacer rotates (at most once a second). Until one rotation fails:
        # when the listing above already saw the spare of the start's own rotation, the first rotation from here
        # still succeeds (into that spare), and a slow machine fitted too few rotations into a fixed four pods.
        for i in range(8):  # the sim's 8 devices
            simple_pod(env.pod_dir, f"p{i}", RES)
            pod = wait_settled(agent, f"p{i}")
            assert pod["admitted"], pod
            admitted[f"p{i}"] = devices_of(pod, RES)
            time.sleep(0.5)
            if i >= 3 and pacer_failed():
                break
        wait_for(pacer_failed, timeout=15, what="the checkpoint pacer's failure counted")
        wait_for(lambda: "task checkpoint-pacer is down: IsADirectoryError" in readyz(agent),
                 timeout=15, interval=0.05, what="/readyz naming the checkpoint pacer")  # fmt: skip
        assert "background checkpoint failed" in agent.log()
        agent.kill()
        for seq in range(highest + 1, highest + 4):  # the disk has room again (a directory would fail the replay)
            segment_path(journal_dir, seq).rmdir()
        env.start_agent()
        restarted: AgentProcess | None = env.agent
        assert restarted is not None
        # Restored from the checkpoint and journal (not admitted afresh), with the devices they were reported with.
        view = {name: wait_settled(restarted, name) for name in admitted}
        assert all(pod["admitted"] and pod["restored"] for pod in view.values()), view
        assert {name: devices_of(pod, RES) for name, pod in view.items()} == admitted
