"""`AdmissionRunner.settled` / `when_settled` (what the debug admit entry and benchmarks/allocation.py wait with), on
a real agent in this process: giving up a wait leaves the admission running, and an admission cancelled by the pod's
removal ends the wait with the record gone instead of raising."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deviceplane.agent.app import Agent, AgentConfig
from deviceplane.core.pod_table import PodRecord, PodState
from deviceplane.core.pods import Container, Pod


def waiting_pod(uid: str) -> Pod:
    # a resource no plugin serves: the admission waits out the startup plugin wait
    return Pod(uid, "ns", uid, "Pending", (), (Container("main", (("example.com/nobody", 1),)),))


async def test_a_given_up_wait_leaves_the_admission_and_a_removal_ends_the_wait(short_tmp: Path) -> None:
    # plugin dir, PodResources socket, node name, grace period, HTTP address
    agent = Agent(AgentConfig(short_tmp / "dp", short_tmp / "pr.sock", "n", 300, "127.0.0.1:0", startup_plugin_wait=30))
    await agent.start()
    try:
        runner = agent.admission
        runner.pod_set("test", "a", waiting_pod("uid-a"))
        seen: list[PodRecord | None] = []
        runner.when_settled("uid-a", seen.append)
        try:
            await asyncio.wait_for(runner.settled("uid-a"), 0.2)
            raise AssertionError("settled before the startup wait ended")
        except TimeoutError:
            pass
        record = agent.pods.get("uid-a")
        assert record is not None and record.state == PodState.ADMITTING and "waiting up to 30s" in record.reason
        assert seen == []  # still admitting: the wait that gave up did not cancel it
        runner.pod_gone("test", "a")  # cancels the admission
        assert await asyncio.wait_for(runner.settled("uid-a"), 5) is None
        await asyncio.sleep(0)
        assert seen == [None]
        # a pod with nothing in flight answers at once
        runner.when_settled("uid-nobody", seen.append)
        assert seen == [None, None]
    finally:
        await agent.stop()


async def test_waiters_hear_the_end_from_the_admissions_last_step_and_a_failing_waiter_spoils_nothing(
    short_tmp: Path,
) -> None:
    agent = Agent(AgentConfig(short_tmp / "dp", short_tmp / "pr.sock", "n", 300, "127.0.0.1:0", startup_plugin_wait=0))
    await agent.start()
    try:
        runner = agent.admission
        runner.pod_set("test", "b", waiting_pod("uid-b"))  # no plugin serves its resource: it fails at once
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "admit ns/uid-b")
        heard: list[tuple[PodState | None, bool]] = []

        def broken(_record: PodRecord | None) -> None:
            raise RuntimeError("a waiter's bug")

        runner.when_settled("uid-b", broken)
        runner.when_settled("uid-b", lambda record: heard.append((record and record.state, task.done())))
        record = await asyncio.wait_for(runner.settled("uid-b"), 5)
        assert record is not None and record.state == PodState.FAILED
        # Told from the admission's own last step (its task not yet done), despite the waiter before it raising.
        assert heard == [(PodState.FAILED, False)]
        await asyncio.sleep(0)
        assert task.done() and task.exception() is None
    finally:
        await agent.stop()
