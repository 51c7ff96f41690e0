"""Crash consistency at the edges: the kubelet taking over a directory the agent was SIGKILLed in, odd state at
start, and the journal's spare segment made late."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deviceplane.agent.state.checkpoint_store import CheckpointStore
from deviceplane.agent.state.journal import Journal, alloc_record, checkpoint_record
from deviceplane.core.checkpoint import PodDevicesEntry
from deviceplane.core.pod_devices import PodDevices
from tests.integration.test_allocation_journal import alloc, state
from tests.support.alloc_env import alloc_env
from tests.support.pods import container, devices_of, pod_manifest, wait_settled, write_pod
from tests.support.procs import wait_for

RES = "example.com/sim"
RESP = b"\x0a\x05\x0a\x01\x41\x12\x00"  # ContainerAllocateResponse{envs:{"A":""}} (spec §4.9)


def _pod(pod_dir: Path, name: str) -> None:
    write_pod(pod_dir, f"{name}.json", pod_manifest(name, [container("main", {RES: 1})], uid=f"uid-{name}"))


def test_kubelet_checkpoint_written_after_a_sigkill_wins_over_the_older_journal(short_tmp: Path) -> None:
    """Agent SIGKILLed within a pacing interval of an admission: the checkpoint lacks the pod (what a kubelet taking
    over sees). The kubelet hands that device to another pod and writes its checkpoint; when the agent comes back,
    its older journal must not give the device to the first pod again."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        env.sim(RES, 2, 0, "--no-pre-start")
        wait_for(lambda: (env.plugin_dir / "kubelet_internal_checkpoint").exists(), what="first checkpoint")
        _pod(env.pod_dir, "a")
        assert env.agent is not None
        held_a = devices_of(wait_settled(env.agent, "a"), RES)
        env.agent.kill()  # well within the 1 s pacing interval of the admission
        cp = CheckpointStore(env.plugin_dir)
        data = cp.read()
        assert data is not None
        # What a kubelet taking over sees: the admission is in the journal only (docs/agent.md, Durability).
        assert not [e for e in data.PodDeviceEntries or [] if e.PodUID == "uid-a"]
        # The kubelet admits pod k onto the device it sees free (a's) and rewrites the checkpoint.
        [device] = held_a
        entry = PodDevicesEntry(PodUID="uid-k", ContainerName="main", ResourceName=RES, DeviceIDs={-1: [device]},
                                AllocResp=RESP)  # fmt: skip
        cp.write(dataclasses.replace(data, PodDeviceEntries=[*(data.PodDeviceEntries or []), entry]))
        _pod(env.pod_dir, "k")  # both pods are on the node
        env.start_agent()
        view = {name: wait_settled(env.agent, name) for name in ("a", "k")}
        assert devices_of(view["k"], RES) == {device}, view["k"]
        owners: dict[str, str] = {}
        for name, pod in view.items():
            for held in devices_of(pod, RES):
                assert held not in owners, f"{held} held by {owners[held]} and {name}"
                owners[held] = name
        assert "journal older than the checkpoint" in env.agent.log()


def test_agent_after_a_clean_stop_keeps_its_journal(short_tmp: Path) -> None:
    """The marker logic must not drop our own journal: SIGKILL right after an admission, restart, pod kept."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        env.sim(RES, 2, 0, "--no-pre-start")
        _pod(env.pod_dir, "a")
        assert env.agent is not None
        held = devices_of(wait_settled(env.agent, "a"), RES)
        env.agent.kill()
        env.start_agent()
        pod = wait_settled(env.agent, "a")
        assert pod["admitted"] and pod.get("restored") and devices_of(pod, RES) == held
        # The plugin back: stopping disconnects it, which changes the checkpoint (its devices turn unhealthy). That
        # checkpoint must be journaled as ours too (it was written after the journal closed, unmarked).
        env.wait_devices(RES, 2)
        env.agent.stop()
        env.start_agent()
        pod = wait_settled(env.agent, "a")
        assert pod["admitted"] and devices_of(pod, RES) == held
        assert "journal older" not in env.agent.log()


async def test_late_spare_does_not_truncate_the_segment_in_use(tmp_path: Path) -> None:
    """The spare of segment N+2 is made in a worker thread after the switch to N+1. When that thread starts late
    (the default executor busy: slow checkpoint writes) and a second rotation has already switched to N+2, the
    late spare must not truncate N+2 (zeroing records made durable) nor unlink it when replaced."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    journal = Journal(tmp_path, segment_bytes=64 << 10)
    journal.replay(PodDevices())
    journal.open()
    gate = threading.Event()
    busy = loop.run_in_executor(None, gate.wait)  # the executor's only worker is taken
    try:
        await journal.rotate().switched  # to 2 (the spare made at open); the spare of 3 queues behind `busy`
        await journal.rotate().switched  # to 3: made by the switch itself
        await journal.append(alloc_record(alloc("p0", "d0")))  # durable, in segment 3
    finally:
        gate.set()
    await busy
    await asyncio.gather(asyncio.to_thread(lambda: None))  # the queued spare work has run by now
    await asyncio.sleep(0.05)
    # A crash now: what does a restart find?
    pds = PodDevices()
    Journal(tmp_path).replay(pds)
    assert state(pds) == {"p0": {"d0"}}
    await journal.close()


async def test_records_journaled_after_adopting_a_kubelet_checkpoint_survive_the_next_crash(tmp_path: Path) -> None:
    """A start that finds a kubelet's checkpoint ignores the older journal; what that run journals before its own
    first checkpoint must not be ignored with it at the next start (the ignored segments, whose marks still do not
    name the kubelet's checkpoint, were left in place: an admission reported durable was lost)."""
    ours = Journal(tmp_path)
    ours.replay(PodDevices())
    ours.open()
    await ours.append(checkpoint_record(111))
    await ours.append(alloc_record(alloc("p0", "d0")))
    await ours.close()
    # SIGKILL; a kubelet takes over and writes checkpoint 222, which lacks p0. The agent comes back.
    adopting = Journal(tmp_path)
    assert adopting.replay(PodDevices(), 222) == 0
    adopting.open()
    await adopting.append(alloc_record(alloc("p1", "d1")))  # p1 admitted, durable
    # SIGKILLed before its first checkpoint: the next start still finds the kubelet's checkpoint.
    after = PodDevices()
    Journal(tmp_path).replay(after, 222)
    await adopting.close()
    assert state(after) == {"p1": {"d1"}}
