"""The startup plugin wait (`--startup-plugin-wait`): right after start, plugins are given a moment to come back.

A restarted agent knows resources whose plugins have not registered again yet: those restored from the checkpoint,
and any a pod asks for. Until a plugin registers and sends its first ListAndWatch list (spec §4.9 read path),
usually within a second, its resource reads 0 devices and disconnected. Two things would act on that false picture,
and both wait here instead, for at most the startup wait:
- an admission that needs the resource (admitter.py), which the kubelet would refuse at once (kubernetes#118559);
- the first NodeDevices write (kube/node_devices.py), which would publish every restored device as gone and flip the
  node's conditions for that second.
"Back" is one notion for both: registered, and its first list applied, even an empty one. An empty list is the
plugin's answer, not an absence: a pod asking for its devices fails at once, as it would later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable

from deviceplane.agent.plugins.contracts import DeviceEvent, DeviceEventKind
from deviceplane.core.registry import DeviceRegistry

log = logging.getLogger("deviceplane.plugins.startup_wait")

# After the agent starts, how long admissions and the first NodeDevices write wait for plugins to come back.
STARTUP_PLUGIN_WAIT_SECONDS = 10.0


class StartupPluginWait:
    """A device listener (every device event may be a plugin coming back). The wait counts from construction, and
    again from `start` (the agent calls it once it serves registrations)."""

    def __init__(
        self,
        registry: DeviceRegistry,
        seconds: float = STARTUP_PLUGIN_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._seconds = seconds
        self._clock = clock
        self._deadline = clock() + seconds
        self._restored: set[str] = set()
        self._started = asyncio.Event()
        # Replaced at every change, set as it is replaced: a waiter takes the current one before it looks at the
        # registry, so a change after its look wakes it, whichever waiter runs first (none clears it for the others).
        self._changed = asyncio.Event()

    def restored(self, resources: Iterable[str]) -> None:
        """At start: the resources restored (the checkpoint's, and those the restored allocations hold: a journal
        record can name a resource the checkpoint, written a moment later, did not have yet)."""
        self._restored = set(resources)

    def start(self) -> None:
        """The wait counts from here."""
        self._deadline = self._clock() + self._seconds
        self._started.set()

    def over(self) -> bool:
        return self._clock() >= self._deadline

    def __call__(self, event: DeviceEvent) -> None:
        if event.kind is DeviceEventKind.DELETED:  # its grace period ended first: nothing left to wait for
            self._restored.discard(event.resource)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def missing(self, resources: Iterable[str]) -> list[str]:
        """Of `resources`, those whose plugin is not back, by name."""
        return sorted(r for r in resources if not self._registry.plugin_listed(r))

    def reason(self, missing: Iterable[str]) -> str:
        """What a pod or a publisher waiting for `missing` says it waits for."""
        return f"waiting up to {self._seconds:g}s after start for device plugins: {', '.join(missing)}"

    async def wait_for(
        self, resources: Collection[str], waiting: Callable[[list[str]], None] | None = None
    ) -> list[str]:
        """Until the plugins of `resources` are all back, or the wait is over; `waiting` is told what is missing
        whenever that changes. `resources` is read again at every look (the restored set shrinks as resources are
        deleted). Returns what is still missing (empty when all came back)."""
        told: list[str] | None = None
        while True:
            changed = self._changed
            missing = self.missing(resources)
            remaining = self._deadline - self._clock()
            if not missing or remaining <= 0:
                return missing
            if waiting is not None and missing != told:
                waiting(missing)
                told = missing
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    # -- the restored resources (what the first NodeDevices write waits for) -------------------------------------

    async def wait_restored(self) -> None:
        """Until every restored resource's plugin is back, or the wait is over (not before `start`: the restored
        resources are known only then)."""
        await self._started.wait()
        missing = await self.wait_for(self._restored)
        if missing:
            log.warning(
                "device plugins of restored resources not back after the startup wait; publishing them as they are",
                extra={"resources": missing, "startup_wait": self._seconds},
            )

    def restored_pending(self) -> list[str]:
        """Restored resources whose plugin is not back yet, by name."""
        return self.missing(self._restored)

    def restored_problem(self) -> str | None:
        """What a publisher still waits for, for /readyz; None when nothing."""
        pending = [] if self.over() else self.restored_pending()
        return self.reason(pending) if pending else None
