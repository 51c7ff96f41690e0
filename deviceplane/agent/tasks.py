"""Long-lived asyncio tasks of the agent: started by name, cancelled together at stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from deviceplane.aio import cancel_and_wait

TaskFactory = Callable[[], Awaitable[None]]


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
