"""The supervisor on its own: failures are logged with the traceback, counted, reported down, restarted with
backoff; cancellation at stop is not a failure."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from deviceplane.agent.supervisor import Supervisor


def restarts(registry: CollectorRegistry, task: str) -> float | None:
    return registry.get_sample_value("deviceplane_agent_task_restarts_total", {"task": task})


async def until(check, within: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_failing_task_is_seen_and_restarted_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    supervisor = Supervisor(registry, initial_backoff=0.2, max_backoff=0.4)
    runs: list[float] = []
    fail = asyncio.Event()

    async def task() -> None:
        runs.append(asyncio.get_running_loop().time())
        await fail.wait()
        fail.clear()
        raise RuntimeError("boom")

    supervisor.add("worker", task)
    assert restarts(registry, "worker") == 0.0
    supervisor.start()
    await until(lambda: len(runs) == 1)
    assert supervisor.problem() is None
    with caplog.at_level(logging.ERROR, logger="deviceplane.agent.supervisor"):
        fail.set()
        await until(lambda: supervisor.problem() is not None)
    assert supervisor.problem() == "task worker is down: RuntimeError: boom; restarting in 0.2s"
    assert restarts(registry, "worker") == 1.0
    [record] = caplog.records
    assert record.task == "worker" and record.exc_info is not None  # type: ignore[attr-defined]
    await until(lambda: len(runs) == 2)
    assert supervisor.problem() is None
    assert runs[1] - runs[0] >= 0.2
    fail.set()  # the second failure waits twice as long
    await until(lambda: len(runs) == 3)
    assert supervisor.problem() is None
    assert restarts(registry, "worker") == 2.0
    await supervisor.stop()
    assert supervisor.problem() is None and restarts(registry, "worker") == 2.0


async def test_ending_counts_as_failure_and_stop_does_not() -> None:
    registry = CollectorRegistry()
    supervisor = Supervisor(registry, initial_backoff=0.05)
    ran = asyncio.Event()

    async def short() -> None:
        ran.set()

    async def forever() -> None:
        await asyncio.Event().wait()

    supervisor.add("short", short)
    supervisor.start()
    supervisor.add("forever", forever)  # added while running: starts at once
    await until(lambda: (restarts(registry, "short") or 0) >= 2)
    await until(lambda: "task short is down: ended; restarting in" in (supervisor.problem() or ""))
    assert supervisor.inject_fault("forever")
    await until(lambda: restarts(registry, "forever") == 1.0)
    await supervisor.stop()
    assert restarts(registry, "forever") == 1.0
    with pytest.raises(ValueError, match="already supervised"):
        supervisor.add("short", short)


async def test_a_stray_cancellation_inside_a_task_is_a_failure_not_a_silent_end() -> None:
    """A task that ends with a CancelledError the supervisor did not cause (a future cancelled under it, as a call
    cancelled by its closing channel) must be seen, counted and restarted like any failure: re-raising it ended the
    supervision silently, with nothing down in /readyz."""
    registry = CollectorRegistry()
    supervisor = Supervisor(registry, initial_backoff=0.05, max_backoff=0.05)
    runs = 0

    async def task() -> None:
        nonlocal runs
        runs += 1
        doomed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, doomed.cancel)
        await doomed

    supervisor.add("worker", task)
    supervisor.start()
    await until(lambda: runs >= 3)
    assert restarts(registry, "worker") >= 2.0
    await supervisor.stop()
    assert supervisor.problem() is None
