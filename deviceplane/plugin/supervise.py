"""Keep a plugin's long-lived task running: none of them may die unseen, and none may end the plugin.

The agent has a full supervisor (deviceplane.agent.supervisor); the SDK stays self-contained with this small form of
the same rule: a task that raises (or returns, although it should run forever) is logged - with the traceback when it
raised - and started again after a backoff that doubles up to MAX_BACKOFF, and starts over from INITIAL_BACKOFF once
a run lasted HEALTHY_AFTER seconds. Cancellation (the plugin stopping) ends it quietly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("deviceplane.plugin")

INITIAL_BACKOFF = 0.5
MAX_BACKOFF = 30.0
HEALTHY_AFTER = 60.0

TaskFactory = Callable[[], Awaitable[None]]


async def keep_running(name: str, factory: TaskFactory) -> None:
    """Run `factory()` again and again until cancelled; `factory` builds a fresh coroutine for each run."""
    backoff = INITIAL_BACKOFF
    while True:
        started = time.monotonic()
        failure = await _run_once(factory)
        if time.monotonic() - started >= HEALTHY_AFTER:
            backoff = INITIAL_BACKOFF
        if failure is None:
            log.error("%s ended unexpectedly; restarting it in %.1f s", name, backoff)
        else:
            log.error("%s failed; restarting it in %.1f s", name, backoff, exc_info=failure)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF)


async def _run_once(factory: TaskFactory) -> Exception | None:
    """The exception one run ended with, None if it returned; cancellation propagates."""
    try:
        await factory()
    except Exception as err:
        return err
    return None
