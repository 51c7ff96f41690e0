"""The agent's resources in its Node's `status.capacity` and `status.allocatable`, as the kubelet keeps them.

One strategic merge patch names only our resources, so every other key (cpu, memory, pods, resources of other
agents) is left alone. A resource whose plugin is gone past the grace period is written as 0, as the kubelet does
for removed device plugins (it never deletes the key). Writes happen only when the wanted values differ from the
last successful write, coalesced (a burst of device events is one patch); a failed write is retried with backoff,
always with the newest values (memory holds one desired state, however long the API server is away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import KubeApi, off_loop
from deviceplane.agent.kube.errors import KubeError
from deviceplane.core.registry import Capacity

log = logging.getLogger("deviceplane.kube.node_status")

COALESCE_SECONDS = 0.05
# How often the Node is read back and compared: repairs what someone else changed (or a Node re-created).
RESYNC_SECONDS = 60.0

Counts = dict[str, dict[str, str]]  # {"capacity": {resource: "n"}, "allocatable": {...}}


class NodeStatusPublisher:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        capacity: Callable[[], Capacity],
        coalesce: float = COALESCE_SECONDS,
        resync: float = RESYNC_SECONDS,
        backoff: Backoff | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.capacity = capacity
        self.coalesce = coalesce
        self.resync = resync
        self.backoff = backoff or Backoff()
        self.published = False  # the first write succeeded
        self.writes = 0
        self._names: set[str] = set()  # every resource ever published: gone ones are written as 0
        self._written: Counts | None = None
        self._wake = asyncio.Event()

    def changed(self, *_args: object) -> None:
        """Something may have changed (a device-manager observer): publish soon."""
        self._wake.set()

    def wanted(self) -> Counts:
        current = self.capacity()
        self._names.update(current.capacity)
        return {
            field: {name: str(values.get(name, 0)) for name in sorted(self._names)}
            for field, values in (("capacity", current.capacity), ("allocatable", current.allocatable))
        }

    async def run(self) -> None:
        self._wake.set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.resync)
            if not self._wake.is_set():
                await self._verify()
            await asyncio.sleep(self.coalesce)
            self._wake.clear()
            wanted = self.wanted()
            if wanted == self._written:
                continue
            try:
                await off_loop(self.api.patch_node_status, self.node, {"status": wanted})
            except KubeError as err:
                delay = self.backoff.delay()
                log.warning("cannot publish node status; retrying", extra={"error": str(err), "retry_in": delay})
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            self.backoff.reset()
            self._written = wanted
            self.published = True
            self.writes += 1
            log.info("node status published", extra={"node": self.node, "allocatable": wanted["allocatable"]})

    async def _verify(self) -> None:
        """Read the Node back; if our keys differ from what we wrote, forget the write so the next pass repeats it."""
        if self._written is None:
            return  # nothing written to compare with: no need to read the Node
        try:
            node = await off_loop(self.api.get_node, self.node)
        except KubeError as err:
            log.warning("cannot read the node back", extra={"error": str(err)})
            return
        status = (node or {}).get("status") or {}
        for field, values in self._written.items():
            seen = status.get(field) or {}
            if any(seen.get(name) != value for name, value in values.items()):
                log.info("node status differs from what was published; writing again", extra={"field": field})
                self._written = None
                self._wake.set()
                return

    def ready(self) -> str | None:
        return None if self.published else "node status not published yet"
