"""Directory change notifications (inotify through watchfiles), with a slow safety tick.

Events drive everything; the tick (an empty batch every `tick` seconds) only exists to re-check state in case an
event was missed, e.g. between listing a directory and the watch being established.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from watchfiles import Change, awatch

# watchfiles logs every batch at INFO ("3 changes detected"): noise in a plugin's log, where we log what matters.
logging.getLogger("watchfiles.main").setLevel(logging.WARNING)

# Group a burst of changes (10,000 files created by a script) into one batch, yet react within ~50 ms when quiet.
DEBOUNCE_MS = 200
STEP_MS = 30


async def dir_changes(
    directory: Path, stop: threading.Event, tick: float = 2.0
) -> AsyncIterator[set[tuple[Change, str]]]:
    """Batches of (change, file name) in `directory` (not recursive); an empty batch every `tick` s of quiet.

    `stop` must be set before the consuming task is cancelled: watchfiles waits in a worker thread that only
    notices `stop`, so cancelling without it would wait up to `tick` seconds.
    """
    async for changes in awatch(
        directory,
        watch_filter=None,  # every file counts, editor temp files included: callers decide what matters
        debounce=DEBOUNCE_MS,
        step=STEP_MS,
        stop_event=stop,
        rust_timeout=int(tick * 1000),
        yield_on_timeout=True,
        recursive=False,
    ):
        yield {(change, Path(path).name) for change, path in changes}
