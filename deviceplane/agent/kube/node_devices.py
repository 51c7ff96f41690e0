"""`NodeDevices/<node>`: the agent's devices view (the model of `/api/v1/devices`) in the cluster.

The object is named after the node and owned by its Node, so deleting the Node garbage-collects it. Its status is
written with a merge patch on the status subresource:
- debounced: at most one write per `debounce` interval, so a flapping device costs one write per interval, not one
  per flap. Device events wake the publisher; allocation changes are noticed by polling a cheap generation counter
  once per interval (building the status costs ~20 ms for 10 x 1,000 devices, benchmarks/nodedevices.py);
- skipped when nothing but the heartbeat would change; a heartbeat write every `heartbeat` seconds says the agent
  is alive;
- bounded: at most `max_devices` devices listed per resource (`devicesTruncated` says so), counts stay exact;
- not before the owners are known (`owners_known`, in proxy mode the kubelet's first PodResources listing): a
  restarted agent never publishes held devices as free;
- with two conditions, `PluginsConnected` and `DevicesHealthy` (`kubectl wait --for=condition=...`), whose
  lastTransitionTime moves only when their status does (kept across agent restarts: read back from the object).
A failed write is retried with backoff with the newest state; a missing object (first start, or collected after
its Node was re-created) is created again. A missing Node is waited for at a short pace
(`NODE_MISSING_RETRY_MAX_SECONDS`), not the growing backoff: an agent started before its Node's registration
publishes within seconds of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import GROUP, VERSION, KubeApi
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.mode import NODEDEVICES_DEBOUNCE_SECONDS, NODEDEVICES_MAX_DEVICES
from deviceplane.aio import off_loop
from deviceplane.api.models import DevicesStatus

log = logging.getLogger("deviceplane.kube.node_devices")

HEARTBEAT_SECONDS = 60.0
ALLOCATION_POLL_FLOOR_SECONDS = 0.05  # `--nodedevices-debounce 0` spun the loop polling the allocation counter
# Retries while the Node does not exist (yet): the growing backoff reached 30 s, so the object appeared up to 30 s
# after its Node. A missing Node is short-lived (an agent started before the registration, a Node re-created).
NODE_MISSING_RETRY_MAX_SECONDS = 2.0

Condition = dict[str, str]  # type, status, reason, message, lastTransitionTime (the CRD's condition)


class NodeMissing(KubeError):
    """The Node does not exist (yet): NodeDevices cannot be created without its owner."""


def without_heartbeat(status: dict[str, Any]) -> dict[str, Any]:
    agent = {k: v for k, v in (status.get("agent") or {}).items() if k != "lastHeartbeatTime"}
    return {**status, "agent": agent}


def plugins_connected(resources: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(status, reason, message) of `PluginsConnected`: a resource whose plugin's stream is down has no allocatable
    devices until it is back."""
    down = [r["name"] for r in resources if not r["plugin"]["connected"]]
    if down:
        return "False", "PluginDisconnected", f"not connected: {', '.join(down)}"
    return "True", "AllConnected", f"{len(resources)} of {len(resources)} plugins connected"


def devices_healthy(resources: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(status, reason, message) of `DevicesHealthy`, naming each resource with unhealthy devices."""
    unhealthy = [f"{r['name']}: {r['unhealthy']} of {r['capacity']} unhealthy" for r in resources if r["unhealthy"]]
    if unhealthy:
        return "False", "UnhealthyDevices", "; ".join(unhealthy)
    return "True", "AllHealthy", f"{sum(r['healthy'] for r in resources)} devices healthy"


CONDITIONS: dict[str, Callable[[list[dict[str, Any]]], tuple[str, str, str]]] = {
    "PluginsConnected": plugins_connected,
    "DevicesHealthy": devices_healthy,
}


def conditions(status: dict[str, Any], previous: Mapping[str, Condition]) -> list[Condition]:
    """The conditions of `status`; a condition whose status is unchanged keeps its lastTransitionTime, a changed one
    takes the status's time (the agent's heartbeat, when it was built)."""
    now = str(status["agent"]["lastHeartbeatTime"])
    result = []
    for kind, judge in CONDITIONS.items():
        state, reason, message = judge(status["resources"])
        before = previous.get(kind)
        since = before["lastTransitionTime"] if before is not None and before.get("status") == state else now
        result.append(
            {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": since}
        )
    return result


def conditions_by_type(obj: dict[str, Any] | None) -> dict[str, Condition]:
    """The conditions found on an existing object (what an earlier agent wrote), by type."""
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    return {str(c["type"]): c for c in found if isinstance(c, dict) and "type" in c and "lastTransitionTime" in c}


def node_devices_object(node: dict[str, Any]) -> dict[str, Any]:
    name = node["metadata"]["name"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodeDevices",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "deviceplane-agent"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node["metadata"]["uid"]},
            ],
        },
        "spec": {"nodeName": name},
    }


class NodeDevicesPublisher:
    def __init__(
        self,
        api: KubeApi,
        node: str,
        status: Callable[[int], DevicesStatus],
        allocations: Callable[[], int] = lambda: 0,
        owners_known: Callable[[], Awaitable[object]] | None = None,
        debounce: float = NODEDEVICES_DEBOUNCE_SECONDS,
        heartbeat: float = HEARTBEAT_SECONDS,
        max_devices: int = NODEDEVICES_MAX_DEVICES,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.node = node
        self.status = status
        self.allocations = allocations
        self.owners_known = owners_known
        self.debounce = debounce
        self.heartbeat = heartbeat
        self.max_devices = max_devices
        self.backoff = backoff or Backoff()
        self.node_missing_backoff = Backoff(maximum=NODE_MISSING_RETRY_MAX_SECONDS)
        self.clock = clock
        self.published = False
        self.writes = 0
        self._exists = False
        self._written: dict[str, Any] | None = None  # last written status, heartbeat left out
        self._written_at = float("-inf")
        self._allocations_seen: int | None = None
        self._conditions: dict[str, Condition] = {}  # the last computed, by type: their transition times
        self._wake = asyncio.Event()

    def changed(self, *_args: object) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self.owners_known is not None:
            await self.owners_known()
        last_attempt = float("-inf")
        while True:
            with contextlib.suppress(TimeoutError):
                # The allocation counter is polled at this pace: never a busy loop, even with no debounce.
                await asyncio.wait_for(self._wake.wait(), max(self.debounce, ALLOCATION_POLL_FLOOR_SECONDS))
            heartbeat_due = self.clock() - self._written_at >= self.heartbeat
            if not (self._wake.is_set() or heartbeat_due or self.allocations() != self._allocations_seen):
                continue
            wait = last_attempt + self.debounce - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            self._allocations_seen = self.allocations()
            status = self.status(self.max_devices).model_dump(mode="json")
            content = without_heartbeat(status)
            if content == self._written and self.clock() - self._written_at < self.heartbeat:
                continue
            last_attempt = self.clock()
            try:
                await self._write(status)
            except KubeError as err:
                delay = self._retry_delay(err)
                log.warning("cannot publish NodeDevices; retrying", extra={"error": str(err), "retry_in": delay})
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            self.backoff.reset()
            self.node_missing_backoff.reset()
            self._written = content
            self._written_at = self.clock()
            self.published = True
            self.writes += 1

    def _with_conditions(self, status: dict[str, Any]) -> dict[str, Any]:
        found = conditions(status, self._conditions)
        self._conditions = {c["type"]: c for c in found}
        return {**status, "conditions": found}

    def _retry_delay(self, err: KubeError) -> float:
        return self.node_missing_backoff.delay() if isinstance(err, NodeMissing) else self.backoff.delay()

    async def _write(self, status: dict[str, Any]) -> None:
        if not self._exists:
            await self._ensure_object()
        try:
            # Conditions are derived from the resources (their times move only with their status), so comparing
            # statuses without them is enough; added after `_ensure_object`, which recovers an earlier agent's times.
            await off_loop(self.api.patch_node_devices_status, self.node, self._with_conditions(status))
        except KubeError as err:
            if err.status == 404:
                self._exists = False  # deleted meanwhile (its Node re-created, or by hand): create it again
            raise

    async def _ensure_object(self) -> None:
        existing = await off_loop(self.api.get_node_devices, self.node)
        if existing is None:
            node = await off_loop(self.api.get_node, self.node)
            if node is None:
                needs = f"NodeDevices/{self.node} needs it as its owner"
                raise NodeMissing(f"node {self.node} does not exist: {needs}", 404)
            try:
                await off_loop(self.api.create_node_devices, node_devices_object(node))
            except KubeError as err:
                if err.status != 409:  # 409: created meanwhile, fine
                    raise
            log.info("NodeDevices created", extra={"node": self.node})
        elif not self._conditions:  # a restarted agent: the transition times an earlier one wrote still hold
            self._conditions = conditions_by_type(existing)
        self._exists = True

    def ready(self) -> str | None:
        return None if self.published else "NodeDevices not published yet"
