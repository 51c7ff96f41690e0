"""The agent's resources in its Node's `status.capacity` and `status.allocatable`, as the kubelet keeps them.

One strategic merge patch names only our resources, so every other key (cpu, memory, pods, resources of other
agents) is left alone. A resource whose plugin is gone past the grace period is written as 0, as the kubelet does
for removed device plugins (it never deletes the key). Writes happen only when the wanted values differ from the
last successful write, coalesced (a burst of device events is one patch); a failed write is retried with backoff,
always with the newest values (memory holds one desired state, however long the API server is away). A Node that
does not exist (yet) is retried at a short pace instead (`NODE_MISSING_RETRY_MAX_SECONDS`), so an agent started
before its Node's registration publishes within seconds of it.

Started without a checkpoint (the node was recreated: `reset_extended_resources`), the publisher first reads the
Node and its first write also zeroes every other extended resource found there, as the kubelet does at
registration (reconcileExtendedResource); those are not ours afterwards, so they are not written again.

After a restart the resources restored from the checkpoint are written at once, 0 until their plugins are back,
as the kubelet does (spec §4.5: checkpointed resources report 0/0 until their plugin re-registers): capacity is what
the scheduler places pods by, and no pod should be placed on devices whose plugin is not back. NodeDevices, a report
of the devices, waits for the plugins instead (node_devices.py).

Every `resync` seconds (a monotonic deadline, however often device events wake the loop) the Node is read back and
our keys compared as quantities (the API server stores 1000 as "1k"); a difference is written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from deviceplane.agent.kube.backoff import NODE_MISSING_RETRY_MAX_SECONDS, Backoff
from deviceplane.agent.kube.client import KubeApi
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.publishing import PublishRecord
from deviceplane.aio import off_loop
from deviceplane.core.names import is_extended_resource_name
from deviceplane.core.pods import PodError, parse_quantity
from deviceplane.core.registry import Capacity

log = logging.getLogger("deviceplane.kube.node_status")

COALESCE_SECONDS = 0.05
# How often the Node is read back and compared: repairs what someone else changed (or a Node re-created).
RESYNC_SECONDS = 60.0

Counts = dict[str, dict[str, str]]  # {"capacity": {resource: "n"}, "allocatable": {...}}


def quantity_differs(wanted: str, seen: object) -> bool:
    """Whether the Node's value `seen` is not the quantity `wanted`; anything unparsable is a difference."""
    try:
        return parse_quantity(seen, "node status") != int(wanted)
    except PodError:
        return True


def extended_resources(node: dict[str, Any] | None) -> set[str]:
    """The extended resources in the Node's capacity (what the kubelet zeroes on a recreated node)."""
    capacity = ((node or {}).get("status") or {}).get("capacity") or {}
    return {name for name in capacity if is_extended_resource_name(str(name))}


class NodeStatusPublisher:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        capacity: Callable[[], Capacity],
        coalesce: float = COALESCE_SECONDS,
        resync: float = RESYNC_SECONDS,
        backoff: Backoff | None = None,
        reset_extended_resources: bool = False,
        record: PublishRecord | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.capacity = capacity
        self.coalesce = coalesce
        self.resync = resync
        self.backoff = backoff or Backoff()
        self.node_missing_backoff = Backoff(maximum=NODE_MISSING_RETRY_MAX_SECONDS)
        self._reset_pending = reset_extended_resources  # no checkpoint at start: the node was recreated
        self.record = record or PublishRecord("node status")
        self.writes = 0
        self._names: set[str] = set()  # every resource ever published: gone ones are written as 0
        self._stale: set[str] = set()  # extended resources found on a recreated node, zeroed by the next write
        self._written: Counts | None = None
        self._wake = asyncio.Event()
        self._verify_at = 0.0  # monotonic time of the next read-back

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

    def patch(self, wanted: Counts) -> Counts:
        """`wanted`, plus 0 for the stale extended resources not in it."""
        stale = {name: "0" for name in sorted(self._stale - set(wanted["capacity"]))}
        return {field: stale | values for field, values in wanted.items()}

    async def run(self) -> None:
        self._wake.set()
        self._verify_at = time.monotonic() + self.resync
        while True:
            await self._next_pass()
            wanted = self.wanted()
            if wanted != self._written:
                await self._publish(wanted)

    async def _next_pass(self) -> None:
        """Wait to be woken, or for the read-back when it is due; a due read-back is done first (whatever the
        wake-ups, so a steady stream of device events cannot postpone it), then a burst of wake-ups is coalesced."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, self._verify_at - time.monotonic()))
        if time.monotonic() >= self._verify_at:
            self._verify_at = time.monotonic() + self.resync
            await self._verify()
        await asyncio.sleep(self.coalesce)
        self._wake.clear()

    async def _publish(self, wanted: Counts) -> None:
        try:
            if self._reset_pending:  # once: read what is on the Node before the first write
                self._stale = extended_resources(await off_loop(self.api.get_node, self.node))
                self._reset_pending = False
            await off_loop(self.api.patch_node_status, self.node, {"status": self.patch(wanted)})
        except KubeError as err:
            self.record.failed(err)
            # 404: the Node does not exist (yet); the growing backoff would have published up to 30 s after it did.
            delay = self.node_missing_backoff.delay() if err.status == 404 else self.backoff.delay()
            log.warning("cannot publish node status; retrying", extra={"error": str(err), "retry_in": delay})
            await asyncio.sleep(delay)
            self._wake.set()
            return
        self.backoff.reset()
        self.node_missing_backoff.reset()
        if self._stale:
            zeroed = sorted(self._stale - set(wanted["capacity"]))
            log.info("stale extended resources zeroed", extra={"node": self.node, "resources": zeroed})
            self._stale = set()
        self._written = wanted
        self.record.succeeded()
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
            if any(quantity_differs(value, seen.get(name)) for name, value in values.items()):
                log.info("node status differs from what was published; writing again", extra={"field": field})
                self._written = None
                self._wake.set()
                return

    @property
    def published(self) -> bool:
        """A write has succeeded since start."""
        return self.record.published

    def ready(self) -> str | None:
        return self.record.not_ready()
