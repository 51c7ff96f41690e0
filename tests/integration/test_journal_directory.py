"""The journal lives in a directory of its own inside the device-plugin directory: device plugins watch the
device-plugin directory (inotify, not recursive) for kubelet.sock, and must not be woken by every admission's write.
Segments an earlier version left in the device-plugin directory are moved in at start and replayed."""

from __future__ import annotations

from pathlib import Path

from deviceplane.agent.state.journal import (
    JOURNAL_DIRNAME,
    Journal,
    adopt_segments,
    alloc_record,
    list_segments,
    release_record,
)
from deviceplane.core.constants import CHECKPOINT_NAME, CHECKPOINT_TEMP_PREFIX
from deviceplane.core.pod_devices import PodDevices
from tests.integration.test_allocation_journal import alloc
from tests.support.alloc_env import alloc_env
from tests.support.inotify import FSNOTIFY_EVENTS, read_events, watch
from tests.support.pods import devices_of, simple_pod, wait_settled

RES = "example.com/sim"


def test_admissions_do_not_wake_a_plugin_watching_the_plugin_directory(short_tmp: Path) -> None:
    """Before the journal had its own directory, each admission's journal write was an IN_MODIFY event in the
    device-plugin directory, read by every plugin watching it for kubelet.sock."""
    with alloc_env(short_tmp) as env:
        agent = env.start_agent()
        env.sim(RES, 16, 0, "--no-pre-start")
        with watch(env.plugin_dir, FSNOTIFY_EVENTS) as fd:
            read_events(fd)
            syncs_before = agent.metric("deviceplane_journal_sync_duration_seconds_count") or 0.0
            for i in range(12):
                simple_pod(env.pod_dir, f"p{i}", RES)
                assert wait_settled(agent, f"p{i}")["admitted"]
            synced = (agent.metric("deviceplane_journal_sync_duration_seconds_count") or 0.0) - syncs_before
            events = read_events(fd)
        assert synced >= 12, synced  # the admissions were journaled, durably
        assert not [name for _mask, name in events if name.startswith("deviceplane_allocations.")], events
        # What is left is the background checkpoint (paced: at most once a second, as the kubelet writes its own):
        # its temp file, then the rename over the checkpoint.
        others = [
            name for _mask, name in events if name != CHECKPOINT_NAME and not name.startswith(CHECKPOINT_TEMP_PREFIX)
        ]
        assert not others, events
        assert list_segments(env.plugin_dir / JOURNAL_DIRNAME)


def test_segments_an_earlier_version_left_in_the_plugin_directory_are_replayed(short_tmp: Path) -> None:
    """An upgrade after a crash: the admission is in the journal only, in the device-plugin directory (where the
    earlier version kept it; the segment format is the same). The new agent moves it in and restores the pod."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        env.sim(RES, 2, 0, "--no-pre-start")
        simple_pod(env.pod_dir, "a", RES)
        agent = env.agent
        assert agent is not None
        held = devices_of(wait_settled(agent, "a"), RES)
        agent.kill()  # within the checkpoint's pacing interval: the pod is in the journal only
        journal_dir = env.plugin_dir / JOURNAL_DIRNAME
        segments = list_segments(journal_dir)
        assert segments
        for _seq, path in segments:
            path.rename(env.plugin_dir / path.name)
        env.start_agent()
        pod = wait_settled(env.agent, "a")
        assert pod["admitted"] and pod.get("restored") and devices_of(pod, RES) == held, pod
        assert not list_segments(env.plugin_dir)
        assert "journal segments moved into the journal directory" in env.agent.log()


async def test_adopted_segments_replay_after_the_ones_already_there(tmp_path: Path) -> None:
    """A downgrade and an upgrade again: the journal directory holds the older segments, the plugin directory the
    newer ones. They are appended after, in their order, so a release journaled later wins over the older alloc."""
    journal_dir = tmp_path / JOURNAL_DIRNAME
    first = Journal(journal_dir, segment_bytes=64 << 10)
    first.replay(PodDevices())
    first.open()
    await first.append(alloc_record(alloc("p0", "d0")))
    await first.close()
    older = Journal(tmp_path, segment_bytes=64 << 10)  # the earlier version's layout
    older.replay(PodDevices())
    older.open()
    await older.append(release_record("p0"))
    await older.append(alloc_record(alloc("p1", "d1")))
    await older.close()
    before = list_segments(tmp_path)

    assert adopt_segments(tmp_path, journal_dir) == len(before)

    assert not list_segments(tmp_path)
    pod_devices = PodDevices()
    assert Journal(journal_dir).replay(pod_devices) == 3
    assert pod_devices.pods() == {"p1"}
    assert adopt_segments(tmp_path, journal_dir) == 0  # nothing left to move
