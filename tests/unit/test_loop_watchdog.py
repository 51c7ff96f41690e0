"""The loop watchdog's decisions (`StallDetector`, fed times by hand), its stack dump, and the real watchdog on a real
loop in this process: a blocked loop is reported once and its resumption once, and the thread ends with its owner."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from deviceplane.loop_watchdog import THREAD_NAME, LoopWatchdog, StallDetector, StallKind, thread_stacks


def test_one_stalled_and_one_resumed_per_stall_with_its_length() -> None:
    detector = StallDetector(threshold=1.0, interval=0.25, repeat_every=60.0)
    # the heartbeat is due 0.25 s after it ran; only overdue by more than the threshold is a stall
    assert detector.observe(now=10.0 + 0.25 + 1.0, beat=10.0) is None
    stalled = detector.observe(now=11.3, beat=10.0)
    assert stalled is not None and stalled.kind is StallKind.STALLED and stalled.seconds == pytest.approx(1.3)
    assert detector.stalled
    for now in (11.5, 20.0, 60.0, 70.0):  # every later poll of the same stall: nothing new
        assert detector.observe(now, beat=10.0) is None
    resumed = detector.observe(now=80.1, beat=80.0)  # the loop ran the heartbeat again at 80.0
    assert resumed is not None and resumed.kind is StallKind.RESUMED and resumed.seconds == pytest.approx(70.0)
    assert not detector.stalled
    assert detector.observe(now=80.2, beat=80.0) is None  # and the next polls are quiet again


def test_a_long_stall_dumps_again_at_the_slow_interval() -> None:
    detector = StallDetector(threshold=1.0, interval=0.25, repeat_every=60.0)
    kinds = [e.kind for now in (2.0, 30.0, 61.9, 62.0, 100.0, 122.0) if (e := detector.observe(now, beat=0.0))]
    assert kinds == [StallKind.STALLED, StallKind.STILL_STALLED, StallKind.STILL_STALLED]


def test_a_stall_no_poll_saw_is_reported_by_the_heartbeat_that_ends_it() -> None:
    """Polls every 0.5 s, threshold 2 s: a 2.4 s hold is overdue past the threshold for under 0.15 s, so a poll
    may not land inside it. The heartbeat after it still reports it, once; one a poll saw is left to the poll."""
    detector = StallDetector(threshold=2.0, interval=0.25)
    assert detector.observe(now=2.3, beat=0.1) is None  # overdue by 1.95 s: no stall yet
    unseen = detector.on_beat(previous=0.1, now=2.5)  # the hold ended: 2.15 s overdue
    assert unseen is not None and unseen.kind is StallKind.ENDED_UNSEEN and unseen.seconds == pytest.approx(2.4)
    assert detector.on_beat(previous=2.5, now=2.75) is None  # an ordinary heartbeat
    seen = detector.observe(now=5.3, beat=2.75)
    assert seen is not None and seen.kind is StallKind.STALLED
    assert detector.on_beat(previous=2.75, now=5.4) is None  # the poll reported it: not twice
    resumed = detector.observe(now=5.5, beat=5.4)
    assert resumed is not None and resumed.kind is StallKind.RESUMED


def test_a_short_hold_and_a_reset_count_nothing() -> None:
    detector = StallDetector(threshold=0.5, interval=0.25)
    beat = 0.0
    for step in range(1, 200):  # polls every 0.05 s; the heartbeat due every 0.25 s, in odd seconds 0.4 s late
        now = step * 0.05
        if now - beat >= 0.25 + (0.4 if int(now) % 2 else 0.0):
            beat = now
        assert detector.observe(now, beat) is None
    assert detector.observe(now=12.0, beat=beat) is not None
    detector.reset()  # the loop was stopped: no stall under way, and no "resumed" for it
    assert not detector.stalled and detector.observe(now=12.0, beat=11.9) is None


def test_the_stack_dump_puts_the_loop_thread_first_and_leaves_the_caller_out() -> None:
    parked = threading.Barrier(3)
    release = threading.Event()

    def parked_here() -> None:
        parked.wait(5)
        release.wait(10)

    # named so that sorting by name alone would put the loop thread last
    others = [threading.Thread(target=parked_here, name=name) for name in ("a-worker", "z-loop")]
    for thread in others:
        thread.start()
    try:
        parked.wait(5)
        text = thread_stacks(loop_thread=others[1].ident)
    finally:
        release.set()
        for thread in others:
            thread.join()
    sections = text.split("--- thread ")[1:]
    assert sections[0].startswith(f"z-loop ({others[1].ident}) [event loop] ---") and "in parked_here" in sections[0]
    assert any(s.startswith("a-worker ") for s in sections[1:])
    assert "test_the_stack_dump_puts_the_loop_thread_first" not in text  # the caller's own stack is not there
    assert sum("[event loop]" in s for s in sections) == 1


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)


async def test_a_real_loop_held_is_reported_once_and_the_thread_ends_at_stop(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    watchdog = LoopWatchdog(0.3, registry, "deviceplane_agent", heartbeat=0.05)
    assert registry.get_sample_value("deviceplane_agent_event_loop_stalls_total") == 0.0
    assert registry.get_sample_value("deviceplane_agent_event_loop_last_stall_seconds") == 0.0
    caplog.set_level(logging.WARNING, "deviceplane.loop_watchdog")
    watchdog.start()
    try:
        await asyncio.sleep(0.3)
        hold_the_loop(1.0)
        await asyncio.sleep(0.5)  # the heartbeat runs again, the thread sees it at its next poll
        hold_the_loop(0.1)  # under the threshold
        await asyncio.sleep(0.3)
    finally:
        watchdog.stop()
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    records = [(r.getMessage(), r.__dict__) for r in caplog.records]
    assert [m for m, _ in records] == ["event loop stalled", "event loop resumed"], records
    assert "in hold_the_loop" in records[0][1]["stacks"].split("--- thread ")[1]  # the loop thread's section
    assert 1.0 <= records[1][1]["stalled_seconds"] <= 1.0 + 0.05 + 0.2
    assert registry.get_sample_value("deviceplane_agent_event_loop_stalls_total") == 1.0
    assert 1.0 <= (registry.get_sample_value("deviceplane_agent_event_loop_last_stall_seconds") or 0) < 1.3
    assert (registry.get_sample_value("deviceplane_agent_event_loop_lag_seconds_count") or 0) >= 10


def test_the_thread_ends_with_its_loop_when_stop_is_never_called() -> None:
    registry = CollectorRegistry()
    watchdog = LoopWatchdog(0.2, registry, "deviceplane_agent", heartbeat=0.05)

    async def forgetful_owner() -> None:
        watchdog.start()
        await asyncio.sleep(0.1)

    asyncio.run(forgetful_owner())  # the loop is closed; nobody called stop()
    deadline = time.monotonic() + 2
    while [t for t in threading.enumerate() if t.name == THREAD_NAME] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert registry.get_sample_value("deviceplane_agent_event_loop_stalls_total") == 0.0  # a closed loop: no stall


def test_a_disabled_threshold_is_refused() -> None:
    with pytest.raises(ValueError):
        LoopWatchdog(0, CollectorRegistry(), "deviceplane_agent")
