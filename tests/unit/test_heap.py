"""The heap keeper (agent/heap.py): CPython's collections timed by generation, settles at quiet moments only, full
settles that reclaim what freezing would otherwise keep. Runs in this process's own collector, restored after each
test."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry

from deviceplane.agent.heap import FORCED_AFTER_INTERVALS, GC_THRESHOLDS, QUIET_SECONDS, HeapKeeper
from deviceplane.agent.in_flight import InFlight
from deviceplane.aio import cancel_and_wait


@pytest.fixture(autouse=True)
def own_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    callbacks = list(gc.callbacks)
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    gc.callbacks[:] = callbacks


class Quiet:
    """Stands in for the admissions in flight: seconds since the last one ended, 0 while one runs."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self._ended = time.monotonic() - 3600.0

    def end(self) -> None:
        self.busy = False
        self._ended = time.monotonic()

    def __call__(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self._ended


def settles(registry: CollectorRegistry, kind: str) -> float:
    return registry.get_sample_value("deviceplane_agent_heap_settle_seconds_count", {"kind": kind}) or 0.0


def cpython_passes(registry: CollectorRegistry, generation: str) -> float:
    return registry.get_sample_value("deviceplane_agent_gc_pause_seconds_count", {"generation": generation}) or 0.0


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_freezes_what_exists_and_makes_young_collections_rarer() -> None:
    registry = CollectorRegistry()
    keeper = HeapKeeper(Quiet(busy=False), registry, interval=10.0)
    keeper.start()
    try:
        assert gc.get_freeze_count() > 1000  # the modules, classes and functions imported so far at least
        assert gc.get_threshold() == GC_THRESHOLDS
        assert settles(registry, "full") == 1
        assert registry.get_sample_value("deviceplane_agent_gc_frozen_objects") == gc.get_freeze_count()
    finally:
        keeper.stop()


def test_the_frozen_count_is_taken_at_each_settle_not_at_each_scrape() -> None:
    """`deviceplane_agent_gc_frozen_objects` is the count at the last settle: a scrape must not walk every frozen
    object (gc.get_freeze_count() does, ~7 ms of the loop with 10 x 10,000 devices registered); objects frozen later
    show at the next settle, and stopping (everything unfrozen) shows 0."""
    registry = CollectorRegistry()
    keeper = HeapKeeper(Quiet(busy=False), registry, interval=10.0)
    keeper.start()
    try:
        at_start = registry.get_sample_value("deviceplane_agent_gc_frozen_objects")
        assert at_start == gc.get_freeze_count()
        kept = [Cycle() for _ in range(2_000)]
        gc.collect()
        gc.freeze()  # frozen by someone else than a settle: not counted until the next settle
        assert registry.get_sample_value("deviceplane_agent_gc_frozen_objects") == at_start
        keeper.settle(full=False)
        assert registry.get_sample_value("deviceplane_agent_gc_frozen_objects") == gc.get_freeze_count()
        assert gc.get_freeze_count() >= at_start + len(kept)
    finally:
        keeper.stop()
    assert registry.get_sample_value("deviceplane_agent_gc_frozen_objects") == 0


def test_stop_gives_the_collector_back_as_it_was() -> None:
    before, callbacks = gc.get_threshold(), len(gc.callbacks)
    keeper = HeapKeeper(Quiet(busy=False), CollectorRegistry(), interval=10.0)
    keeper.start()
    assert gc.get_freeze_count() > 0 and len(gc.callbacks) == callbacks + 1
    keeper.stop()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
    assert len(gc.callbacks) == callbacks


def test_interval_zero_leaves_cpythons_collector_and_still_times_it() -> None:
    registry = CollectorRegistry()
    before = gc.get_threshold()
    keeper = HeapKeeper(Quiet(busy=False), registry, interval=0)
    keeper.start()
    try:
        assert not keeper.settling
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
        gc.collect(1)
        gc.collect()
        assert cpython_passes(registry, "1") == 1
        assert cpython_passes(registry, "2") == 1
        assert settles(registry, "full") == settles(registry, "recent") == 0
    finally:
        keeper.stop()
    gc.collect()
    assert cpython_passes(registry, "2") == 1  # stopped: no longer timed


def test_a_settle_is_timed_as_a_settle_not_as_cpythons_pass() -> None:
    registry = CollectorRegistry()
    keeper = HeapKeeper(Quiet(busy=False), registry, interval=10.0)
    keeper.start()
    try:
        keeper.settle(full=False)
        assert settles(registry, "recent") == 1
        assert cpython_passes(registry, "2") == 0
    finally:
        keeper.stop()


def test_only_a_full_settle_reclaims_a_cycle_frozen_before_it_became_garbage() -> None:
    registry = CollectorRegistry()
    keeper = HeapKeeper(Quiet(busy=False), registry, interval=10.0)
    cycle = Cycle()
    alive = weakref.ref(cycle)
    keeper.start()  # freezes the cycle while it is still in use
    try:
        del cycle
        keeper.settle(full=False)
        assert alive() is not None  # frozen: a recent settle does not look at it
        keeper.settle(full=True)
        assert alive() is None
    finally:
        keeper.stop()


@contextlib.asynccontextmanager
async def settling(keeper: HeapKeeper) -> AsyncIterator[None]:
    """The keeper's loop running, as the agent's supervisor runs it, until the block ends."""
    task = asyncio.create_task(keeper.run())
    try:
        yield
    finally:
        await cancel_and_wait([task])


def test_a_due_settle_waits_for_a_quiet_moment() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        quiet = Quiet(busy=True)
        async with settling(HeapKeeper(quiet, registry, interval=1.0, full_every=1000)):
            await asyncio.sleep(1.1)  # due at 1.0 s, the traffic goes on
            assert settles(registry, "recent") == 0
            quiet.end()  # quiet enough at ~1.35 s
            await asyncio.sleep(QUIET_SECONDS - 0.1)
            assert settles(registry, "recent") == 0
            await asyncio.sleep(0.35)
            assert settles(registry, "recent") == 1

    asyncio.run(scenario())


def test_without_a_quiet_moment_a_recent_settle_is_forced_late_and_a_full_one_never() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        quiet = Quiet(busy=True)
        # full_every=1: every settle should be a full one
        async with settling(HeapKeeper(quiet, registry, interval=0.2, full_every=1)):
            forced_at = 0.2 * (1 + FORCED_AFTER_INTERVALS)
            await asyncio.sleep(forced_at - 0.3)  # due at 0.2 s, the traffic goes on
            assert settles(registry, "recent") == 0
            await asyncio.sleep(0.4)
            assert settles(registry, "recent") == 1
            assert settles(registry, "full") == 0  # owed, but never forced
            quiet.busy = False  # idle for long: the next one (0.2 s after the forced one) is the full pass
            await asyncio.sleep(0.2)
            assert settles(registry, "full") == 1
            assert settles(registry, "recent") == 1

    asyncio.run(scenario())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="settle interval"):
        HeapKeeper(Quiet(busy=False), CollectorRegistry(), interval=-1)
    with pytest.raises(ValueError, match="full_every"):
        HeapKeeper(Quiet(busy=False), CollectorRegistry(), interval=1, full_every=0)


def test_in_flight_counts_quiet_time_from_the_last_end() -> None:
    now = [100.0]
    work = InFlight(lambda: now[0])
    now[0] = 101.0
    assert work.quiet_for() == 1.0  # nothing ran yet: quiet since it was made
    with work:
        with work:
            now[0] = 105.0
            assert work.quiet_for() == 0.0
        now[0] = 106.0
        assert work.quiet_for() == 0.0 and work.count == 1
    assert work.quiet_for() == 0.0  # ended just now (106.0)
    now[0] = 107.5
    assert work.quiet_for() == 1.5
