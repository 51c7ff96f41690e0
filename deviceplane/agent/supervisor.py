"""Supervision of the agent's long-lived tasks: none of them may die unseen.

Every long-lived task (pod sources, watchers, background writers, sweeps, servers' loops) runs under one
`Supervisor`. When a task raises, or returns although it should run forever, the supervisor

- logs it (with the traceback when it raised),
- counts it in `deviceplane_agent_task_restarts_total{task}`,
- reports the task as down in `problem()` (the agent's `/readyz` serves it, naming the task) until it runs again,
- restarts it after a backoff: `initial_backoff`, doubling up to `max_backoff`; a task that ran `healthy_after`
  seconds before failing starts again from `initial_backoff`.

Usage, from the composition root::

    supervisor = Supervisor(metrics_registry)
    supervisor.add("pod-source:file", lambda: source.run(sink))   # a factory: called again for every restart
    supervisor.start()                                            # tasks added later start at once
    ...
    problem = supervisor.problem()                                # None, or "task pod-source:file is down: ..."
    await supervisor.stop()                                       # cancels every task and waits for them

The factory must build a fresh coroutine each time; state the task keeps across restarts lives in its object.
Cancellation (agent shutdown) is never treated as a failure.

`inject_fault(name)` makes a running task fail as if its loop had raised at its current await (it is cancelled
with a marker, unwinds through its own cleanup, and the supervisor handles it exactly as a crash). It exists for
tests and is reachable only through the debug endpoint the agent serves when `DEVICEPLANE_DEBUG_FAULTS=1`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from deviceplane.agent.tasks import TaskFactory
from deviceplane.aio import cancel_and_wait

log = logging.getLogger("deviceplane.agent.supervisor")

INITIAL_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0


class InjectedFault(Exception):
    """What a task fails with when a test injects a fault into it."""


@dataclass(slots=True)
class _Supervised:
    name: str
    factory: TaskFactory
    runner: asyncio.Task[None] | None = None  # the supervisor's loop for this task
    current: asyncio.Task[str] | None = None  # the task's own run, restarted by the runner
    down_reason: str | None = None
    restart_at: float | None = None
    fault_pending: bool = False


class Supervisor:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        initial_backoff: float = INITIAL_BACKOFF_SECONDS,
        max_backoff: float = MAX_BACKOFF_SECONDS,
        healthy_after: float = HEALTHY_AFTER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.healthy_after = healthy_after
        self.clock = clock
        self.restarts = Counter(
            "deviceplane_agent_task_restarts",
            "Restarts of the agent's long-lived tasks after they failed (raised or ended).",
            ["task"],
            registry=registry,
        )
        self._tasks: dict[str, _Supervised] = {}
        self._started = False

    def add(self, name: str, factory: TaskFactory) -> None:
        """Supervise a long-lived task under a unique name; it starts now if the supervisor is running."""
        if name in self._tasks:
            raise ValueError(f"a task named {name!r} is already supervised")
        supervised = _Supervised(name, factory)
        self._tasks[name] = supervised
        self.restarts.labels(name)  # the series exists (at 0) from the start
        if self._started:
            self._launch(supervised)

    def start(self) -> None:
        self._started = True
        for supervised in self._tasks.values():
            if supervised.runner is None:
                self._launch(supervised)

    def _launch(self, supervised: _Supervised) -> None:
        supervised.runner = asyncio.create_task(self._supervise(supervised), name=f"supervise {supervised.name}")

    async def stop(self) -> None:
        self._started = False
        await cancel_and_wait([s.runner for s in self._tasks.values() if s.runner is not None])
        for supervised in self._tasks.values():
            supervised.runner = supervised.current = None

    # -- status --------------------------------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._tasks)

    def down(self) -> dict[str, str]:
        """Tasks not running right now, with why."""
        return {name: s.down_reason for name, s in self._tasks.items() if s.down_reason is not None}

    def problem(self) -> str | None:
        """For /readyz: None while every task runs, else which are down and why."""
        down = self.down()
        if not down:
            return None
        return "; ".join(f"task {name} is down: {reason}" for name, reason in sorted(down.items()))

    def inject_fault(self, name: str) -> bool:
        """Make a running task fail now (tests only, see the module docstring); False if it is not running."""
        supervised = self._tasks.get(name)
        if supervised is None or supervised.current is None or supervised.current.done():
            return False
        supervised.fault_pending = True
        supervised.current.cancel()
        return True

    # -- the loop ------------------------------------------------------------------------------------------------------

    async def _supervise(self, supervised: _Supervised) -> None:
        backoff = self.initial_backoff
        while True:
            started = self.clock()
            supervised.down_reason = supervised.restart_at = None
            supervised.current = asyncio.create_task(self._run_once(supervised), name=supervised.name)
            try:
                reason = await asyncio.shield(supervised.current)
            except asyncio.CancelledError:
                await cancel_and_wait([supervised.current])
                raise
            if self.clock() - started >= self.healthy_after:
                backoff = self.initial_backoff
            supervised.down_reason = f"{reason}; restarting in {backoff:g}s"
            supervised.restart_at = self.clock() + backoff
            self.restarts.labels(supervised.name).inc()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    async def _run_once(self, supervised: _Supervised) -> str:
        """Run the task once; returns why it stopped (it is always a failure: these tasks run forever)."""
        try:
            await supervised.factory()
        except asyncio.CancelledError as err:
            if supervised.fault_pending:
                supervised.fault_pending = False
                return _failed(supervised.name, InjectedFault("fault injected"))
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # stopped by the supervisor
            # A CancelledError nobody asked this task for (a call cancelled under it, say): a failure like any other,
            # or the task would end unseen, never restarted nor reported down.
            return _failed(supervised.name, err)
        except Exception as err:
            return _failed(supervised.name, err)
        log.error("supervised task ended; restarting it", extra={"task": supervised.name})
        return "ended"


def _failed(name: str, err: BaseException) -> str:
    """Log a task's failure (with the traceback being handled) and say why it stopped."""
    reason = f"{type(err).__name__}: {err}"
    log.error("supervised task failed; restarting it", extra={"task": name, "error": reason}, exc_info=True)
    return reason
