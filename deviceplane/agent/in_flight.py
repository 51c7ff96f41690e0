"""A count of work in flight (admissions, forwarded plugin calls), so housekeeping can wait for a quiet moment."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType


class InFlight:
    __slots__ = ("_clock", "_idle_since", "count")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = 0
        self._clock = clock
        self._idle_since = clock()

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(
        self, _type: type[BaseException] | None, _value: BaseException | None, _traceback: TracebackType | None
    ) -> None:
        self.count -= 1
        if not self.count:
            self._idle_since = self._clock()

    def quiet_for(self) -> float:
        """Seconds since the last work ended; 0 while some is in flight."""
        return 0.0 if self.count else self._clock() - self._idle_since
