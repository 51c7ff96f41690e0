"""StopOnceEventLoop, in process: the first stop signal runs its handler once, and from that moment SIGTERM and
SIGINT go straight from handled to ignored, never through a default disposition, whatever asyncio does next (remove
a handler, close the loop). CI saw the window the first version left: it removed the loop's handlers (asyncio sets
SIG_DFL) before ignoring the signals, and an operator under load died of a SIGTERM that landed in between (-15)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from deviceplane.stop_signals import STOP_SIGNALS, StopOnceEventLoop


@pytest.fixture
def dispositions_set(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, Any]]]:
    """Every disposition set through `signal.signal` while the test runs; the process's own are put back after."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    real = signal.signal
    seen: list[tuple[int, Any]] = []

    def recording(sig: int, handler: Any) -> Any:
        seen.append((sig, handler))
        return real(sig, handler)

    monkeypatch.setattr(signal, "signal", recording)
    try:
        yield seen
    finally:
        monkeypatch.undo()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(wakeup)


@pytest.mark.parametrize("first", STOP_SIGNALS)
def test_the_first_stop_signal_counts_and_no_default_is_ever_put_back(
    dispositions_set: list[tuple[int, Any]], first: signal.Signals
) -> None:
    loop = StopOnceEventLoop()
    calls: list[str] = []
    try:
        loop.add_signal_handler(signal.SIGTERM, calls.append, "term")
        loop.add_signal_handler(signal.SIGINT, calls.append, "int")
        loop.add_signal_handler(signal.SIGUSR1, calls.append, "usr1")  # not a stop signal: handled as usual
        before = len(dispositions_set)

        for sig in (first, *STOP_SIGNALS, first):  # a burst: queued together before the first call runs
            os.kill(os.getpid(), sig)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert calls == ["term" if first == signal.SIGTERM else "int"]
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)

        os.kill(os.getpid(), signal.SIGUSR1)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert calls[1:] == ["usr1"]

        assert loop.remove_signal_handler(signal.SIGTERM) is False  # already forgotten
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test process lives on
    finally:
        loop.close()
    after = dispositions_set[before:]
    stop_changes = [(sig, handler) for sig, handler in after if sig in STOP_SIGNALS]
    assert stop_changes == [(signal.SIGTERM, signal.SIG_IGN), (signal.SIGINT, signal.SIG_IGN)], stop_changes
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)
    assert (signal.SIGUSR1, signal.SIG_DFL) in after  # the loop's close removed SIGUSR1's handler as asyncio does


def test_without_a_stop_signal_the_loop_behaves_as_asyncio(dispositions_set: list[tuple[int, Any]]) -> None:
    loop = StopOnceEventLoop()
    try:
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
        assert loop.remove_signal_handler(signal.SIGTERM) is True
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        loop.close()
