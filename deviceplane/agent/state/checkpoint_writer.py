"""Coalesced, durable checkpoint writes off the event loop.

Every ListAndWatch message and every allocation asks for a write (as the kubelet does); writes are serialised and
requests that arrive while one is in flight share the next write. A caller that needs durability (an admission)
awaits its request: when it returns, a checkpoint containing the state as of the request is on disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from deviceplane.core.checkpoint import CheckpointData

log = logging.getLogger("deviceplane.checkpoint")


class CheckpointWriter:
    def __init__(self, write: Callable[[CheckpointData], None], snapshot: Callable[[], CheckpointData]) -> None:
        self._write = write  # blocking: runs in a worker thread
        self._snapshot = snapshot  # cheap, on the loop: captures the state to persist
        self._next: asyncio.Future[None] | None = None  # shared by every request since the last write started
        self._runner: asyncio.Task[None] | None = None

    def request(self) -> asyncio.Future[None]:
        """Ask for a write reflecting the current state; the future resolves once it is durable (or fails)."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        future = self._next
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._drain(), name="checkpoint-writer")
        return future

    async def _drain(self) -> None:
        while self._next is not None:
            future, self._next = self._next, None
            data = self._snapshot()
            try:
                await asyncio.to_thread(self._write, data)
            except Exception as err:
                log.error("checkpoint write failed: %s", err)
                if not future.done():
                    future.set_exception(err)
                    # Fire-and-forget requesters never read it; don't warn about an unretrieved exception.
                    future.exception()
            else:
                if not future.done():
                    future.set_result(None)

    async def close(self) -> None:
        """Finish pending writes (used at clean shutdown)."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
