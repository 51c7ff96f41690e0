"""The resources a restarted agent restored from its checkpoint, until their plugins are back.

At start a checkpointed resource reads 0 devices, and its plugin disconnected, until the plugin registers again and
sends its first ListAndWatch list (spec §4.9 read path), usually within a second. What the agent publishes from that
window (NodeDevices) would say every device is gone and flip the node's conditions for that second. `wait` lets a
publisher's first write wait until every restored resource has its plugin back (registered, first list applied),
for at most the startup plugin wait (`--startup-plugin-wait`, as admission waits, admitter.py `_wait_for_plugins`);
a plugin that does not come back by then is published as what it is, disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from deviceplane.agent.plugins.contracts import DeviceEvent, DeviceEventKind
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.plugins.restored")


class RestoredPlugins:
    """A device listener (every device event may be a plugin coming back)."""

    def __init__(self, registry: DeviceRegistry, startup_wait: float, clock: Callable[[], float] = time.monotonic):
        self._registry = registry
        self._startup_wait = startup_wait
        self._clock = clock
        self._restored: set[str] = set()
        self._deadline = float("inf")  # until `start`
        self._started = asyncio.Event()
        self._changed = asyncio.Event()

    def restored(self, resources: Iterable[str]) -> None:
        """At start: the resources restored (the checkpoint's, and those the restored allocations hold: a journal
        record can name a resource the checkpoint, written a moment later, did not have yet)."""
        self._restored = set(resources)

    def start(self) -> None:
        """The wait counts from here (the agent serves registrations and admits pods from this point)."""
        self._deadline = self._clock() + self._startup_wait
        self._started.set()

    def __call__(self, event: DeviceEvent) -> None:
        if event.kind is DeviceEventKind.DELETED:  # its grace period ended first: nothing left to wait for
            self._restored.discard(event.resource)
        self._changed.set()

    def pending(self) -> list[str]:
        """Restored resources whose plugin is not back yet, by name."""
        return sorted(r for r in self._restored if not self._registry.plugin_listed(r))

    def problem(self) -> str | None:
        """What a publisher still waits for, for /readyz; None when nothing."""
        pending = self.pending() if self._clock() < self._deadline else []
        if not pending:
            return None
        return f"waiting up to {self._startup_wait:g}s after start for device plugins: {', '.join(pending)}"

    async def wait(self) -> None:
        """Until every restored resource's plugin is back, or the startup wait is over."""
        await self._started.wait()
        while True:
            self._changed.clear()  # before looking: a change after the look wakes the wait below
            pending = self.pending()
            remaining = self._deadline - self._clock()
            if not pending:
                return
            if remaining <= 0:
                log.warning(
                    "device plugins of restored resources not back after the startup wait; publishing them as they are",
                    extra={"resources": pending, "startup_wait": self._startup_wait},
                )
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
