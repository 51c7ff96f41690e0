"""keep_running: a plugin's long-lived task that fails is logged (with its traceback) and started again."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deviceplane.plugin import supervise


async def test_failed_and_ended_runs_are_logged_and_restarted(monkeypatch, caplog):
    monkeypatch.setattr(supervise, "INITIAL_BACKOFF", 0.01)
    runs = 0
    third_run = asyncio.Event()

    async def task() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise ValueError("first run fails")
        if runs == 2:
            return  # a task meant to run forever that returns is a failure too
        third_run.set()
        await asyncio.Event().wait()

    with caplog.at_level(logging.ERROR, logger="deviceplane.plugin"):
        runner = asyncio.create_task(supervise.keep_running("example task", task))
        await asyncio.wait_for(third_run.wait(), 5)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    failed, ended = caplog.records
    assert failed.getMessage().startswith("example task failed; restarting it in")
    assert failed.exc_info is not None and str(failed.exc_info[1]) == "first run fails"
    assert ended.getMessage().startswith("example task ended unexpectedly; restarting it in")
    assert runs == 3
