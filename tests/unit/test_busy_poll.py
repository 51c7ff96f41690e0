"""The busy-poll selector: it polls only inside the armed window, never past its budget or a due timer, and returns
what is ready as the plain selector does. Real sockets; CPU is read from the thread's own clock."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from deviceplane.agent.busy_poll import BusyPoll, BusyPollSelector


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _selector(window: BusyPoll, sock: socket.socket) -> BusyPollSelector:
    selector = BusyPollSelector(window)
    selector.register(sock, selectors.EVENT_READ, "data")
    return selector


def _send_later(sock: socket.socket, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), sock.send(b"x")))
    thread.start()
    return thread


def test_armed_it_returns_what_is_ready_as_the_plain_selector(pair: tuple[socket.socket, socket.socket]) -> None:
    window = BusyPoll(5.0)
    selector = _selector(window, pair[0])
    window.arm()
    sender = _send_later(pair[1], 0.01)
    ready = selector.select(None)
    sender.join()
    assert [(key.data, events) for key, events in ready] == [("data", selectors.EVENT_READ)]
    selector.close()


def test_polling_stops_at_the_budget_then_it_sleeps(pair: tuple[socket.socket, socket.socket]) -> None:
    """A plugin that answers late costs the budget's CPU, not the whole wait's."""
    window = BusyPoll(0.02)
    selector = _selector(window, pair[0])
    window.arm()
    sender = _send_later(pair[1], 0.5)
    cpu = time.thread_time()
    ready = selector.select(None)
    cpu = time.thread_time() - cpu
    sender.join()
    assert ready and cpu < 0.25  # polled ~0.02 s, then slept through the rest (0.5 s of polling would show)
    assert 0.01 < window.polled_seconds < 0.25  # what the metric reports: the polling, not the sleep after it
    selector.close()


def test_disarmed_or_without_budget_it_sleeps(pair: tuple[socket.socket, socket.socket]) -> None:
    disarmed, no_budget = BusyPoll(5.0), BusyPoll(0.0)
    disarmed.arm()
    disarmed.disarm()
    no_budget.arm()  # `--busy-poll 0`: arming does nothing
    for window in (disarmed, no_budget):
        selector = _selector(window, pair[0])
        sender = _send_later(pair[1], 0.3)
        cpu = time.thread_time()
        assert selector.select(None)
        cpu = time.thread_time() - cpu
        sender.join()
        pair[0].recv(16)
        assert cpu < 0.1  # 0.3 s of polling would show
        assert window.polled_seconds == 0.0
        selector.close()


def test_a_due_timer_is_not_overrun(pair: tuple[socket.socket, socket.socket]) -> None:
    window = BusyPoll(5.0)
    selector = _selector(window, pair[0])
    window.arm()
    started = time.monotonic()
    assert selector.select(0.05) == []
    assert time.monotonic() - started < 2.0  # polling for the 5 s budget would overrun the 0.05 s timeout
    assert selector.select(0) == []  # no timeout: one poll, whatever the window
    selector.close()


def test_an_event_loop_made_by_the_window_runs_with_it() -> None:
    window = BusyPoll(5.0)
    loop = window.event_loop()
    try:
        assert isinstance(loop, asyncio.SelectorEventLoop)
        window.arm()
        started = time.monotonic()
        assert loop.run_until_complete(asyncio.sleep(0.05, "slept")) == "slept"
        assert time.monotonic() - started < 2.0  # the timer fired inside the armed window, not after its 5 s
        assert window.polled_seconds > 0  # the loop did poll meanwhile
    finally:
        loop.close()
