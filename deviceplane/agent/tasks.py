"""Long-lived asyncio tasks of the agent: started by name, cancelled together at stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

TaskFactory = Callable[[], Awaitable[None]]


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel every task and wait until each has finished; their outcomes (errors included) are collected, not
    raised."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


class BackgroundTasks:
    """The agent's background loops (grace-period expiry, plugin watcher, pod sources, ...), one task each."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, run: TaskFactory) -> None:
        async def main() -> None:
            await run()

        self._tasks[name] = asyncio.create_task(main(), name=name)

    def ended(self) -> list[str]:
        """Names of tasks that are no longer running (they should run until stopped)."""
        return sorted(name for name, task in self._tasks.items() if task.done())

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks.values())
        self._tasks.clear()
