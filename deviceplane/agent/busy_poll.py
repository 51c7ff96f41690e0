"""Busy polling while an admission waits alone: the event loop polls its sockets instead of sleeping in the kernel.

A sequential admission spends most of its time waiting: for the plugin's Allocate answer, then for the disk. When
the loop sleeps through the plugin's round trip (~0.2-0.4 ms), the CPU idles, and on a virtual machine an idle vCPU
is halted by the host: the answer then has to wake it through the host before the agent reads it. Polling without
sleeping for a bounded time keeps the CPU running through the wait, as the kernel's own busy polling
(`net.core.busy_poll`) and KVM's halt polling do: with it, the RPC's part of a sequential admission takes what a
bare round trip takes, 45-60 µs less here (benchmarks/README.md, "Busy polling"). The disk's wait is a blocking
system call, which polling cannot shorten.

The cost is CPU: at most `budget` seconds of one CPU per plugin call, and only while exactly one admission is in
flight (the admitter arms it then; with more in flight the loop has their work to do, and spinning would take the
CPU the plugins need). Past the budget the loop sleeps as usual. `--busy-poll 0` turns it off.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from collections.abc import Callable

from deviceplane.stop_signals import StopOnceEventLoop

BUSY_POLL_SECONDS = 0.001


class BusyPoll:
    """The window in which the loop polls instead of sleeping: armed by whoever waits, read by the selector."""

    __slots__ = ("budget", "clock", "polled_seconds", "until")

    def __init__(self, budget: float = BUSY_POLL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.clock = clock  # `until` is a reading of it; the selector reads it too
        self.until = 0.0  # the loop polls until this moment; 0: it sleeps as usual
        self.polled_seconds = 0.0  # time spent polling so far (deviceplane_agent_busy_poll_seconds_total)

    def arm(self) -> None:
        """Poll through the next `budget` seconds (a wait starts)."""
        if self.budget > 0:
            self.until = self.clock() + self.budget

    def disarm(self) -> None:
        """The wait is over: sleep as usual again."""
        self.until = 0.0

    def polled(self, seconds: float) -> None:
        """The selector polled this long (counted for the metric)."""
        self.polled_seconds += seconds

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """A loop factory (asyncio.Runner): a selector event loop whose selector honours this window (and on which
        only the first stop signal counts: stop_signals.py)."""
        return StopOnceEventLoop(BusyPollSelector(self))


class BusyPollSelector(selectors.DefaultSelector):
    """The platform's default selector (epoll on Linux), polling without a timeout while the window is open."""

    def __init__(self, window: BusyPoll) -> None:
        super().__init__()
        self._window = window
        self._clock = window.clock  # the one `until` was read from

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        until = self._window.until
        if not until or timeout == 0:
            return super().select(timeout)
        now = started = self._clock()
        if timeout is not None:
            until = min(until, started + timeout)  # a timer due sooner is not overrun
        while now < until:
            ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
            now = self._clock()
            if ready:
                self._window.polled(now - started)
                return ready
            # A process woken on this CPU meanwhile (the plugin, a client) runs now, not once the scheduler takes
            # the CPU from a loop that looks busy (p99 0.80 against 0.89 ms without it: benchmarks/README.md).
            os.sched_yield()
        self._window.polled(now - started)
        return super().select(None if timeout is None else max(0.0, timeout - (now - started)))
