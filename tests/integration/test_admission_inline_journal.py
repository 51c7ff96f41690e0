"""Durability of admissions alone in flight vs concurrent ones, on a real agent in this process and a real sim
plugin process: an admission alone writes its journal records at once, on the event loop; concurrent ones share
group commits, also on the loop (one per loop step, while the disk is fast); and either way every admitted pod is
restored after a restart."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplane.agent.app import Agent, AgentConfig
from deviceplane.core.pod_table import PodState
from deviceplane.core.pods import Container, Pod
from tests.support.plugins import wait_until
from tests.support.procs import ROOT, child_env

RESOURCE = "example.com/sim"


def pod(uid: str) -> Pod:
    return Pod(uid, "ns", uid, "Pending", (), (Container("main", ((RESOURCE, 1),)),))


def config(root: Path) -> AgentConfig:
    # plugin dir, PodResources socket, node name, grace period, HTTP address. Writes stay on the loop however slow the
    # disk: a busy CI disk once took over the 2 ms default for 4 of 20 syncs, which sends the next write to the
    # writer thread, as it should (test_allocation_journal.py covers that switch); here only the loop's share counts.
    return AgentConfig(
        root / "dp", root / "pr.sock", "n", 300, "127.0.0.1:0", startup_plugin_wait=0, journal_inline_sync_limit=60.0
    )


async def admit(agent: Agent, uid: str) -> None:
    agent.admission.pod_set("test", uid, pod(uid))
    record = await agent.admission.settled(uid)
    assert record is not None and record.state == PodState.ADMITTED, record and record.reason


@pytest.fixture
def sim(short_tmp: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The sim plugin, started first: it registers once the agent's kubelet.sock appears."""
    (short_tmp / "dp").mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deviceplane", "plugin", "sim", "--resource", RESOURCE, "--count", "64",
         "--plugin-dir", str(short_tmp / "dp"), "--no-preferred-allocation", "--no-pre-start"],
        cwd=ROOT, env=child_env(),
    )  # fmt: skip
    yield proc
    proc.terminate()
    proc.wait()


async def test_alone_inline_concurrent_grouped_all_restored(short_tmp: Path, sim: subprocess.Popen[bytes]) -> None:
    agent = Agent(config(short_tmp))
    await agent.start()
    try:
        await wait_until(lambda: len(agent.registry.healthy(RESOURCE)) == 64, what="the sim's devices")
        store = agent.allocation_store
        # The start's checkpoint journals its checksum (a write of its own): done before counting; the next one is
        # paced at least a second later, after these admissions.
        await wait_until(lambda: store.checkpoints >= 1, what="the start's checkpoint")
        before = store.journal_inline_syncs
        for i in range(20):
            await admit(agent, f"seq-{i}")
        assert store.journal_inline_syncs - before == 20  # each admission, alone, wrote its record at once
        syncs, inline = store.journal_syncs, store.journal_inline_syncs
        await asyncio.gather(*(admit(agent, f"conc-{i}") for i in range(30)))
        # Concurrent admissions write on the loop too, at most one write each (answers that arrive together share one:
        # test_allocation_journal.py shows the grouping deterministically; here it depends on the sim's timing).
        assert 0 < store.journal_syncs - syncs <= 30
        assert store.journal_inline_syncs - inline == store.journal_syncs - syncs
    finally:
        await agent.stop()
    restarted = Agent(config(short_tmp))
    await restarted.start()
    try:
        held = {uid for uid in restarted.pod_devices.pods()}
        assert held == {f"seq-{i}" for i in range(20)} | {f"conc-{i}" for i in range(30)}
    finally:
        await restarted.stop()
