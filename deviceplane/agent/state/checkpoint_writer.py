"""Coalesced, durable checkpoint writes: encoded on the event loop in slices, written off it.

Every ListAndWatch message and every allocation asks for a write (as the kubelet does); writes are serialised and
requests that arrive while one is in flight share the next write. A caller that needs durability (an admission)
awaits its request: when it returns, a checkpoint containing the state as of the request is on disk.

The encoding is pure Python (~6 ms for 5,000 entries whose texts are kept, ~40 ms when all are new). It runs on the
loop in slices of ~0.5 ms with the loop's other work between them, not in a worker thread: a thread holding the GIL
made the loop wait up to the switch interval (1 ms) after each of its system calls, and 8 concurrent admissions make
dozens of them per millisecond, so an encoding stalled them for about its whole length (benchmarks/README.md). The
file's write and fsyncs, which release the GIL, run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from deviceplane.core.checkpoint import CheckpointData, CheckpointEncoder

log = logging.getLogger("deviceplane.checkpoint")


# The longest the encoding holds the loop at once, besides its final steps (one pass each over the text: ~1-2 ms
# each at 5,000 entries, ~1 MB; benchmarks/README.md).
ENCODE_SLICE_SECONDS = 0.0005


class CheckpointWriter:
    def __init__(
        self,
        write: Callable[[bytes], None],
        snapshot: Callable[[], CheckpointData],
        encoder: CheckpointEncoder,
        slice_seconds: float = ENCODE_SLICE_SECONDS,
        before_write: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> None:
        self._write = write  # blocking, the encoded file: runs in a worker thread
        self._snapshot = snapshot  # cheap, on the loop: captures the state to persist
        self._encoder = encoder
        self._slice_seconds = slice_seconds
        self._next: asyncio.Future[None] | None = None  # shared by every request since the last write started
        self._runner: asyncio.Task[None] | None = None
        # Awaited with each encoded file before it is written (the agent journals its checksum there,
        # durability.journal_checksums); an error fails that write.
        self._before_write = before_write

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
                blob = await self._encode(data)
                if self._before_write is not None:
                    await self._before_write(blob)
                await asyncio.to_thread(self._write, blob)
            except Exception as err:
                log.error("checkpoint write failed: %s", err)
                if not future.done():
                    future.set_exception(err)
                    # Fire-and-forget requesters never read it; don't warn about an unretrieved exception.
                    future.exception()
            else:
                if not future.done():
                    future.set_result(None)

    async def _encode(self, data: CheckpointData) -> bytes:
        slices = self._encoder.encode_in_slices(data, time.perf_counter, self._slice_seconds)
        while True:
            try:
                next(slices)
            except StopIteration as done:
                encoded: bytes = done.value
                return encoded
            await asyncio.sleep(0)  # the loop's ready work runs before the next slice

    async def close(self) -> None:
        """Finish pending writes (used at clean shutdown)."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
