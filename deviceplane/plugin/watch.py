"""Directory change notifications (inotify through watchfiles), with a slow safety tick.

Events drive everything; the tick (an empty batch every `tick` seconds of quiet) only exists to re-check state in
case an event was missed, e.g. between listing a directory and the watch being established. A directory that is
removed and re-created is a new inode the old watch cannot see, so the watch is re-established on the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from watchfiles import Change, awatch

log = logging.getLogger("deviceplane.plugin")

# watchfiles logs every batch at INFO ("3 changes detected"): noise in a plugin's log, where we log what matters.
logging.getLogger("watchfiles.main").setLevel(logging.WARNING)

# Group a burst of changes (10,000 files created by a script) into one batch, yet react within ~50 ms when quiet.
DEBOUNCE_MS = 200
STEP_MS = 30
# While the directory does not exist there is nothing to watch: look for it again this often.
MISSING_RECHECK = 0.5
# How long the watch gets to be set up before the caller is asked to re-read the directory.
SETTLE = 0.05


def _identity(directory: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(directory)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


def _recoverable(err: BaseException) -> bool:
    """Errors a new watch gets past: the directory removed while the watch was being set up, or watchfiles failing
    on one event - e.g. a file name that is not valid UTF-8, which it raises wrapped in an ExceptionGroup."""
    if isinstance(err, BaseExceptionGroup):
        _, rest = err.split((OSError, RuntimeError))
        return rest is None
    return isinstance(err, (OSError, RuntimeError))


def _log_watch_error(directory: Path, err: BaseException, reported: set[str]) -> None:
    # A warning once per distinct problem (a bad name stays until removed), debug after: no log flood.
    message = "; ".join(str(e) for e in err.exceptions) if isinstance(err, BaseExceptionGroup) else str(err)
    level = logging.DEBUG if message in reported else logging.WARNING
    reported.add(message)
    log.log(level, "watching %s: %s; watching it anew", directory, message)


async def dir_changes(
    directory: Path, stop: threading.Event, tick: float = 2.0
) -> AsyncIterator[set[tuple[Change, str]]]:
    """Batches of (change, file name) in `directory` (not recursive); an empty batch on every tick.

    `stop` must be set before the consuming task is cancelled: watchfiles waits in a worker thread that only
    notices `stop`, so cancelling without it would wait up to `tick` seconds.
    """
    reported: set[str] = set()
    while not stop.is_set():
        watched = _identity(directory)
        if watched is None:
            yield set()
            await asyncio.sleep(MISSING_RECHECK)
            continue
        try:
            batches = awatch(
                directory,
                watch_filter=None,  # every file counts, editor temp files included: callers decide what matters
                debounce=DEBOUNCE_MS,
                step=STEP_MS,
                stop_event=stop,
                rust_timeout=int(tick * 1000),
                yield_on_timeout=True,
                recursive=False,
            )
            async with contextlib.aclosing(batches):
                # awatch sets up inotify in the first step of its first iteration. Once that has run, an empty batch
                # makes the caller re-read the directory: what changed before the watch existed is caught by that
                # read, what changes after it produces an event. No window where a change goes unnoticed.
                pending = asyncio.ensure_future(anext(batches))
                try:
                    await asyncio.wait([pending], timeout=SETTLE)
                    yield set()
                    while True:
                        changes = await pending
                        # The directory's own deletion ends this watch for good (inotify watches an inode), even if
                        # a new directory - maybe with the same inode number - appears at the path right after.
                        gone = (Change.deleted, str(directory)) in changes
                        yield {(change, Path(path).name) for change, path in changes if path != str(directory)}
                        if gone or _identity(directory) != watched:
                            log.debug("%s was removed or replaced: watching it anew", directory)
                            break
                        pending = asyncio.ensure_future(anext(batches))
                finally:
                    if not pending.done():
                        pending.cancel()
                        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                            await pending
        except StopAsyncIteration:  # `stop` was set
            return
        except (OSError, RuntimeError, ExceptionGroup) as err:
            if not _recoverable(err):
                raise
            _log_watch_error(directory, err, reported)
            await asyncio.sleep(MISSING_RECHECK)  # then watch anew; its first empty batch makes the caller re-read
