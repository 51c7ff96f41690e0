"""Makes a stalled event loop visible: a heartbeat on the loop, watched from a thread (the agent's loop, and the
operator's, which kopf runs).

/readyz, /metrics and the log calls of the agent all run on its one asyncio loop, as kopf's health endpoint and
handlers do in the operator, so a loop that is blocked (a blocking call, a spin, a deadlock) answers nothing and says
nothing. Here (metric names under the owner's prefix, `deviceplane_agent_` or `deviceplane_operator_`):

- the loop runs a heartbeat every `HEARTBEAT_SECONDS` (`loop.call_later`; nothing per callback, nothing on the
  admission path) that records when it ran and how late (`deviceplane_agent_event_loop_lag_seconds`);
- a daemon thread wakes every quarter of the threshold (0.02-1 s) and asks `StallDetector` about the heartbeat. Once
  a heartbeat is overdue by more than the threshold (`--loop-stall-seconds`) it logs ONE error `event loop stalled`
  with the stacks of every thread (the loop's first, marked `[event loop]`) and counts
  `deviceplane_agent_event_loop_stalls_total`; if the stall lasts, `event loop still stalled` with fresh stacks
  every `REPEAT_DUMP_SECONDS` (a spin moves, a deadlock does not); once the loop runs the heartbeat again, ONE
  warning `event loop resumed` with the stall's length, also kept in `deviceplane_agent_event_loop_last_stall_seconds`;
- a stall that ends between two polls (no poll found the heartbeat overdue) is still counted and logged, without
  stacks, by the heartbeat that ends it: the gap since the one before says it was overdue past the threshold.

A stall's length is the time between the last heartbeat before it and the first after it: at least the time the
loop was held, at most that plus one heartbeat interval. What the thread cannot see: a loop held inside C code that
keeps the GIL (the thread cannot run either), or a log handler that blocks (its own log call blocks too).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from enum import Enum
from sys import _current_frames  # documented CPython API, underscore and all

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("deviceplane.loop_watchdog")

LOOP_STALL_SECONDS = 5.0
HEARTBEAT_SECONDS = 0.25
REPEAT_DUMP_SECONDS = 60.0
THREAD_NAME = "event-loop-watchdog"
# Heartbeat lateness: sub-millisecond when idle, tens of ms under load, seconds in a stall.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class StallKind(Enum):
    STALLED = "stalled"
    STILL_STALLED = "still stalled"
    RESUMED = "resumed"
    ENDED_UNSEEN = "ended unseen"  # found by the heartbeat that ended it: no poll landed inside it


@dataclass(frozen=True, slots=True)
class StallEvent:
    kind: StallKind
    seconds: float  # since the last heartbeat (stalled), or the stall's whole length (resumed)


class StallDetector:
    """The watchdog's decisions, pure: fed the time and the last heartbeat's time at each poll, it answers one
    STALLED per stall, STILL_STALLED every `repeat_every` while it lasts, and one RESUMED when the heartbeat moves."""

    def __init__(self, threshold: float, interval: float, repeat_every: float = REPEAT_DUMP_SECONDS) -> None:
        self.threshold = threshold
        self.interval = interval
        self.repeat_every = repeat_every
        self._stall_beat: float | None = None  # the last heartbeat before the stall under way
        self._next_dump = 0.0

    @property
    def stalled(self) -> bool:
        return self._stall_beat is not None

    def observe(self, now: float, beat: float) -> StallEvent | None:
        if self._stall_beat is None:
            # Overdue, not merely old: the next heartbeat was due `interval` after this one.
            if now - (beat + self.interval) <= self.threshold:
                return None
            self._stall_beat = beat
            self._next_dump = now + self.repeat_every
            return StallEvent(StallKind.STALLED, now - beat)
        if beat != self._stall_beat:
            length = beat - self._stall_beat
            self._stall_beat = None
            return StallEvent(StallKind.RESUMED, length)
        if now >= self._next_dump:
            self._next_dump = now + self.repeat_every
            return StallEvent(StallKind.STILL_STALLED, now - beat)
        return None

    def on_beat(self, previous: float, now: float) -> StallEvent | None:
        """A heartbeat at `now` after one at `previous`: ENDED_UNSEEN when that gap was a stall no poll saw (a poll
        that saw it reported STALLED and will report RESUMED)."""
        if self._stall_beat == previous or now - (previous + self.interval) <= self.threshold:
            return None
        return StallEvent(StallKind.ENDED_UNSEEN, now - previous)

    def reset(self) -> None:
        """Forget a stall under way (the loop was stopped, which is no stall)."""
        self._stall_beat = None


def loop_watchdog(threshold: float, registry: CollectorRegistry, prefix: str) -> LoopWatchdog | None:
    """The watchdog of `--loop-stall-seconds` THRESHOLD, or None for 0 (turned off: no thread, no series)."""
    return LoopWatchdog(threshold, registry, prefix) if threshold > 0 else None


def thread_stacks(loop_thread: int | None) -> str:
    """Every thread's stack but the caller's, the loop thread's first and marked."""
    frames = _current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    order = sorted((ident for ident in frames if ident != me), key=lambda i: (i != loop_thread, names.get(i, "")))
    parts = []
    for ident in order:
        mark = " [event loop]" if ident == loop_thread else ""
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}){mark} ---\n")
        parts.append("".join(traceback.format_stack(frames[ident])))
    return "".join(parts)


class LoopWatchdog:
    """`start()` on the loop to watch (from a coroutine); `stop()` on it again. The series exist from construction."""

    def __init__(
        self,
        threshold: float,
        registry: CollectorRegistry,
        prefix: str,
        heartbeat: float = HEARTBEAT_SECONDS,
        repeat_every: float = REPEAT_DUMP_SECONDS,
    ) -> None:
        if threshold <= 0:
            raise ValueError("the stall threshold must be positive (a disabled watchdog is not built)")
        self.threshold = threshold
        self.heartbeat = heartbeat
        self.poll = min(max(threshold / 4, 0.02), 1.0)
        self._detector = StallDetector(threshold, heartbeat, repeat_every)
        self.stalls = Counter(
            f"{prefix}_event_loop_stalls",
            "Times the event loop ran no heartbeat for longer than --loop-stall-seconds (logged with stacks).",
            registry=registry,
        )
        self.last_stall = Gauge(
            f"{prefix}_event_loop_last_stall_seconds",
            "Length of the event loop's last stall, set when the loop ran again; 0 before any.",
            registry=registry,
        )
        self.lag = Histogram(
            f"{prefix}_event_loop_lag_seconds",
            f"How late the event loop ran its heartbeat (due every {heartbeat:g}s): its scheduling latency.",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._beat = 0.0
        self._due = 0.0
        # The heartbeat's time and the detector are shared by the loop and the thread: one decides per stall.
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._due = self._beat + self.heartbeat
        self._handle = self._loop.call_later(self.heartbeat, self._on_beat)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._watch, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._thread is not None:
            self._stopping.set()
            self._thread.join(timeout=5)  # it wakes at once; the bound only guards against a stuck log handler
            self._thread = None

    # -- on the loop -------------------------------------------------------------------------------------------------

    def _on_beat(self) -> None:
        now = time.monotonic()
        loop = self._loop
        if loop is not None:  # rescheduled first, so nothing below can end the heartbeat
            self._handle = loop.call_later(self.heartbeat, self._on_beat)
        with self._lock:
            unseen = self._detector.on_beat(self._beat, now)
            self._beat = now
        self.lag.observe(max(0.0, now - self._due))
        self._due = now + self.heartbeat
        if unseen is not None:
            self._report_unseen(unseen)

    def _report_unseen(self, event: StallEvent) -> None:
        # No stacks: the loop's own stack now is not the one that held it.
        self.stalls.inc()
        self.last_stall.set(event.seconds)
        log.error(
            "event loop stalled",
            extra={
                "stalled_seconds": round(event.seconds, 3),
                "threshold_seconds": self.threshold,
                "stacks": "not taken: the stall ended between two polls of the watchdog",
            },
        )

    # -- on the watchdog thread --------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll):
            try:
                if not self._check():
                    return
            except Exception:  # a watchdog bug must not end the watching
                log.exception("event loop watchdog failed; going on")

    def _check(self) -> bool:
        """One poll; False once the loop is closed (an owner that never called stop)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        with self._lock:
            if not loop.is_running():
                self._detector.reset()
                return True
            event = self._detector.observe(time.monotonic(), self._beat)
        if event is None:
            return True
        seconds = round(event.seconds, 3)
        if event.kind is StallKind.RESUMED:
            self.last_stall.set(event.seconds)
            log.warning("event loop resumed", extra={"stalled_seconds": seconds})
            return True
        if event.kind is StallKind.STALLED:
            self.stalls.inc()
        log.error(
            "event loop stalled" if event.kind is StallKind.STALLED else "event loop still stalled",
            extra={
                "stalled_seconds": seconds,
                "threshold_seconds": self.threshold,
                "stacks": thread_stacks(self._loop_thread),
            },
        )
        return True
