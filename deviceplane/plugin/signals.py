"""Stop every serving plugin of the process on SIGTERM/SIGINT, so each one removes its socket.

A process may serve several plugins on one loop; `loop.add_signal_handler` keeps one handler per signal, so the
handler is shared and fans out to all plugins currently serving. `DevicePlugin.run()` and `deviceplane plugin` serve
on a StopOnceEventLoop (deviceplane/stop_signals.py): there, once a signal has stopped the plugins, further ones are
ignored until the process exits; a program serving on a loop of its own gets its defaults back when they stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from deviceplane.stop_signals import STOP_SIGNALS

_stoppers: list[Callable[[], None]] = []


def _fire() -> None:
    for stop in list(_stoppers):
        stop()


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    # Signal handlers can only be installed from the main thread; plugins served elsewhere are stopped by their owner.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    if not _stoppers:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, _fire)
    _stoppers.append(stop)
    try:
        yield
    finally:
        _stoppers.remove(stop)
        if not _stoppers:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
