"""What SIGTERM and SIGINT mean to a deviceplane process once one of them has stopped it.

A stop is often not one signal: Ctrl-C held down, or a supervisor repeating SIGTERM. Once the process has acted on
the first, the rest must not interrupt the clean exit it is making. asyncio puts the previous dispositions back as
its loop closes (KeyboardInterrupt for SIGINT, death for SIGTERM), and so does the interpreter for a Python handler
as it finalizes; an ignored signal stays ignored through both.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import TypeVarTuple

Args = TypeVarTuple("Args")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """From now until the process exits, SIGTERM and SIGINT are ignored; `loop`'s handlers for them are removed
    first (it would otherwise put the defaults back as it closes)."""
    for sig in STOP_SIGNALS:
        if loop is not None:
            loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


class StopOnceEventLoop(asyncio.SelectorEventLoop):
    """An event loop on which a stop signal is acted on once: the first SIGTERM or SIGINT runs the handler a library
    added for it (kopf's), and from then on both are ignored. kopf's handler fails on a second signal (its stop future
    is already set: InvalidStateError logged), and asyncio would put the defaults back as kopf's loop closes."""

    def __init__(self) -> None:
        super().__init__()
        self._stop_signalled = False

    def add_signal_handler(self, sig: int, callback: Callable[[*Args], object], *args: *Args) -> None:
        if sig not in STOP_SIGNALS:
            super().add_signal_handler(sig, callback, *args)
            return

        def first_stop() -> None:
            # Signals that arrived together are each queued as a call before the first one runs: only it counts.
            if self._stop_signalled:
                return
            self._stop_signalled = True
            ignore_stop_signals(self)
            callback(*args)

        super().add_signal_handler(sig, first_stop)
