"""Keeping CPython's full collections off the admission path, and timing every collection.

A full (generation 2) collection walks every object the collector tracks, and nothing else runs meanwhile. In the
agent that is ~50,000 objects once started (17-24 ms on a 2-vCPU VM) and ~136,000 with 5,000 containers holding
devices (81 ms). Left to CPython, such a pass starts whenever enough objects have survived, which under load is in
the middle of admissions, and every admission in flight waits for it (`benchmarks/gc_pauses.py`).

So the heap is settled instead:
- at start, what was built (modules, servers, the restored state) is collected once and frozen out of the
  generations (`gc.freeze`): later passes skip it. Young collections then run every 10,000 net allocations instead
  of 700, and CPython's own passes over older objects only as a backstop (GC_THRESHOLDS);
- every `interval` seconds, once no admission (or forwarded call) has been in flight for QUIET_SECONDS, the objects
  that survived since are collected and frozen as well: a pass over only them. Without such a moment for
  FORCED_AFTER_INTERVALS intervals it runs anyway, still over only those;
- every `full_every`-th settle unfreezes everything first, so garbage cycles among frozen objects are reclaimed too:
  the one pass over the whole heap, only ever at a quiet moment (else at a later settle).

CPython's own collections are timed by generation (`deviceplane_agent_gc_pause_seconds`), the settles by kind
(`deviceplane_agent_heap_settle_seconds`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from deviceplane.agent.serving.duration_metrics import DurationsCollector
from deviceplane.core.durations import BucketedDurations

log = logging.getLogger("deviceplane.agent.heap")

SETTLE_INTERVAL_SECONDS = 10.0
# Every this many settles (~10 min apart at the default interval) the whole heap is collected.
FULL_SETTLE_EVERY = 60
# Young collections every 10,000 net allocations (CPython's default 700: one every few admissions), the longest under
# 5 ms in benchmarks/gc_pauses.py; the older generations are left to the settles (CPython's own passes over them stay
# as a backstop, ~10M and ~10G allocations apart).
GC_THRESHOLDS = (10_000, 1_000, 1_000)
# A settle waits for this long without work in flight: admissions often end together (one fdatasync serves a group),
# and the next ones arrive a fraction of a millisecond later.
QUIET_SECONDS = 0.25
# How often a due settle looks again while work is in flight.
QUIET_POLL_SECONDS = 0.01
# A due settle that finds no quiet moment for this many intervals (traffic without a 0.25 s gap for minutes) runs
# anyway. Forced after one more interval instead, it landed in admissions in 2 of 3 runs of benchmarks/gc_pauses.py.
FORCED_AFTER_INTERVALS = 10
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GENERATIONS = ("0", "1", "2")
SETTLE_KINDS = ("recent", "full")


class GcPauses:
    """Times CPython's own collections through `gc.callbacks` (whichever thread runs one: they never overlap); the
    settles' passes, made while `settling` is set, are timed by the keeper instead."""

    def __init__(self) -> None:
        self.durations: dict[tuple[str, ...], BucketedDurations] = {
            (generation,): BucketedDurations(PAUSE_BUCKETS) for generation in GENERATIONS
        }
        self._by_generation = list(self.durations.values())  # indexed by the callback's generation number
        self.settling = False
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if self.settling:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class HeapKeeper:
    """`quiet_for()`: seconds since the last work that a pause would delay (admissions, forwarded calls) ended, 0
    while some is in flight. `interval` 0: no settling, CPython's collector as it is (its pauses are still timed)."""

    def __init__(
        self,
        quiet_for: Callable[[], float],
        prometheus: CollectorRegistry,
        interval: float = SETTLE_INTERVAL_SECONDS,
        full_every: int = FULL_SETTLE_EVERY,
    ) -> None:
        if interval < 0 or full_every < 1:
            raise ValueError(f"settle interval must be >= 0 and full_every >= 1, got {interval}, {full_every}")
        self._quiet_for = quiet_for
        self._interval = interval
        self._full_every = full_every
        self._settles = 0
        self._thresholds_before: tuple[int, int, int] | None = None
        self._pauses = GcPauses()
        prometheus.register(
            DurationsCollector(
                "deviceplane_agent_gc_pause_seconds",
                "Each garbage collection CPython started by itself in the agent process, by generation (2: a full "
                "pass); nothing else runs meanwhile. The heap settles are timed apart.",
                ("generation",),
                self._pauses.durations,
            )
        )
        self._settle_durations: dict[tuple[str, ...], BucketedDurations] = {
            (kind,): BucketedDurations(PAUSE_BUCKETS) for kind in SETTLE_KINDS
        }
        prometheus.register(
            DurationsCollector(
                "deviceplane_agent_heap_settle_seconds",
                "Each heap settle, at a moment with no admission or forwarded call in flight: recent (the objects "
                "that survived since the last one, collected and frozen) or full (the whole heap, unfrozen first).",
                ("kind",),
                self._settle_durations,
            )
        )
        # Counted at each settle, not per scrape: gc.get_freeze_count() walks every frozen object (~8.5 ns each). With
        # 10 x 10,000 devices registered, counting it per scrape held the loop ~5 ms more (9.6 against 4.7 ms,
        # benchmarks/reads.py --agent).
        self._frozen_objects = Gauge(
            "deviceplane_agent_gc_frozen_objects",
            "Objects frozen out of the collector's generations, counted at the last heap settle (skipped by its "
            "passes).",
            registry=prometheus,
        )

    @property
    def settling(self) -> bool:
        return self._interval > 0

    def start(self) -> None:
        """Once started: collect and freeze what exists, and make young collections rarer."""
        self._pauses.install()
        if not self.settling:
            return
        self.settle(full=True)
        self._thresholds_before = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)

    def stop(self) -> None:
        """The collector as it was before `start` (an agent run inside a larger process, as in the tests, leaves it
        nothing frozen)."""
        self._pauses.uninstall()
        if self._thresholds_before is not None:
            gc.set_threshold(*self._thresholds_before)
            self._thresholds_before = None
            gc.unfreeze()
            self._frozen_objects.set(0)

    def settle(self, full: bool) -> None:
        started = time.perf_counter()
        self._pauses.settling = True
        try:
            if full:
                gc.unfreeze()
            gc.collect()
            gc.freeze()
        finally:
            self._pauses.settling = False
        seconds = time.perf_counter() - started
        self._settle_durations[("full" if full else "recent",)].observe(seconds)
        frozen = gc.get_freeze_count()
        self._frozen_objects.set(frozen)
        log.debug("heap settled", extra={"full": full, "seconds": round(seconds, 6), "frozen": frozen})

    async def run(self) -> None:
        """Settle every `interval` seconds at a quiet moment, until cancelled (the agent runs it supervised while
        `settling`)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._interval)
            deadline = loop.time() + self._interval * FORCED_AFTER_INTERVALS
            # Polled: the quiet time is kept by the admission path without signalling (an Event set and cleared per
            # admission would cost every admission for a check made once per interval).
            while (quiet := self._quiet_for()) < QUIET_SECONDS and loop.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(QUIET_SECONDS - quiet if quiet else QUIET_POLL_SECONDS)
            self._settles += 1
            # A full pass never runs in traffic: when no quiet moment came, it waits for the next settle.
            full = self._settles >= self._full_every and self._quiet_for() >= QUIET_SECONDS
            if full:
                self._settles = 0
            self.settle(full)
