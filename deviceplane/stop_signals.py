"""What SIGTERM and SIGINT mean to a deviceplane process once one of them has stopped it.

A stop is often not one signal: Ctrl-C held down, or a supervisor repeating SIGTERM. Once the process has acted on
the first, the rest must not interrupt the clean exit it is making. asyncio puts the default dispositions back when a
handler is removed and as its loop closes (KeyboardInterrupt for SIGINT, death for SIGTERM), after closing the
self-pipe its handlers write to; the interpreter does the same for a Python handler as it finalizes. An ignored signal
stays ignored through all of it, so the first stop signal turns both straight from handled to ignored, never through
a default in between.
"""

from __future__ import annotations

import asyncio
import selectors
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple

Args = TypeVarTuple("Args")
T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals() -> None:
    """From now until the process exits, SIGTERM and SIGINT are ignored (each in one step, from its handler)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopOnceEventLoop(asyncio.SelectorEventLoop):
    """An event loop on which a stop signal is acted on once: the first SIGTERM or SIGINT runs the handler added for
    it (the agent's, the SDK's, kopf's), and from then on both are ignored. kopf's handler fails on a second signal
    (its stop future is already set: InvalidStateError logged), and asyncio would put the defaults back."""

    def __init__(self, selector: selectors.BaseSelector | None = None) -> None:
        super().__init__(selector)
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
            ignore_stop_signals()
            for stop_signal in STOP_SIGNALS:
                self._forget(stop_signal)
            callback(*args)

        super().add_signal_handler(sig, first_stop)

    def remove_signal_handler(self, sig: int) -> bool:
        if self._stop_signalled and sig in STOP_SIGNALS:
            return self._forget(sig)  # ignored for good: no default put back (a signal landing then would end us)
        return super().remove_signal_handler(sig)

    def _forget(self, sig: int) -> bool:
        """Drop this loop's handler for `sig` without touching the signal's disposition."""
        handlers = self._signal_handlers  # type: ignore[attr-defined]  # the base class's, not in typeshed
        if handlers.pop(sig, None) is None:
            return False
        if not handlers:
            signal.set_wakeup_fd(-1)  # as the base class does once no handler is left
        return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a StopOnceEventLoop: for a process whose whole life is `main`."""
    with asyncio.Runner(loop_factory=StopOnceEventLoop) as runner:
        return runner.run(main)
