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
- not before the plugins of the resources restored from the checkpoint are back (`plugins_back`, bounded by the
  startup plugin wait): a restarted agent never publishes them as empty and disconnected for the second it takes
  their plugins to register again, which would move both conditions and their transition times twice;
- with the view's conditions, `PluginsConnected` and `DevicesHealthy`, and in proxy mode `OwnersCurrent`
  (`kubectl wait --for=condition=...`, judged in core/conditions.py), whose lastTransitionTime moves only when their
  status does (kept across agent restarts: read back from the object).
A failed write is retried with backoff with the newest state; a missing object (first start, or collected after
its Node was re-created) is created again. The object each status write returns is checked for its ownerReference
to the Node (no extra request): one removed or changed by hand is restored with a metadata patch, so at the latest
at the next heartbeat. A missing Node is waited for at a short pace
(`NODE_MISSING_RETRY_MAX_SECONDS`), not the growing backoff: an agent started before its Node's registration
publishes within seconds of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from deviceplane.agent.kube.backoff import NODE_MISSING_RETRY_MAX_SECONDS, Backoff
from deviceplane.agent.kube.client import GROUP, VERSION, KubeApi
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.mode import NODEDEVICES_DEBOUNCE_SECONDS, NODEDEVICES_MAX_DEVICES
from deviceplane.agent.kube.publishing import PublishRecord
from deviceplane.aio import off_loop
from deviceplane.api.models import Condition, DevicesStatus
from deviceplane.core.conditions import ConditionTimes

log = logging.getLogger("deviceplane.kube.node_devices")

HEARTBEAT_SECONDS = 60.0
ALLOCATION_POLL_FLOOR_SECONDS = 0.05  # `--nodedevices-debounce 0` spun the loop polling the allocation counter


class RestoredPluginsWait(Protocol):
    """What the first write waits for (agent/plugins/startup_wait.py: the restored resources' plugins)."""

    async def wait_restored(self) -> None: ...

    def restored_problem(self) -> str | None:
        """What is still waited for, for /readyz."""
        ...


class NodeMissing(KubeError):
    """The Node does not exist (yet): NodeDevices cannot be created without its owner."""


def without_heartbeat(status: dict[str, Any]) -> dict[str, Any]:
    """What a write must change: the status but its heartbeat and its conditions' transition times (those the view
    judged may differ from the ones published, `_with_conditions`). The rest of a condition stays: OwnersCurrent
    (proxy mode) turns without any resource changing."""
    agent = {k: v for k, v in (status.get("agent") or {}).items() if k != "lastHeartbeatTime"}
    content = {**status, "agent": agent}
    if "conditions" in status:
        content["conditions"] = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"] or []
        ]
    return content


def conditions_found(obj: Mapping[str, Any] | None) -> list[Condition]:
    """The conditions found on an existing object (what an earlier agent wrote); malformed ones left out."""
    found = ((obj or {}).get("status") or {}).get("conditions") or []
    result = []
    for item in found if isinstance(found, list) else []:
        with contextlib.suppress(ValidationError):
            result.append(Condition.model_validate(item))
    return result


def owner_reference(node: str, uid: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}


def owned_by(obj: Mapping[str, Any], node: str, uid: str | None) -> bool:
    """Whether `obj` names the Node `node` (with `uid`, when known) as an owner, and no other Node."""
    refs = [r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if is_node_ref(r)]
    return len(refs) == 1 and refs[0].get("name") == node and (uid is None or refs[0].get("uid") == uid)


def is_node_ref(ref: Any) -> bool:
    return isinstance(ref, dict) and ref.get("kind") == "Node" and ref.get("apiVersion") == "v1"


def owners_patch(obj: Mapping[str, Any], node: str, uid: str) -> dict[str, Any]:
    """A merge patch giving `obj` the Node's ownerReference (other owners kept), refused by the API server (409) if
    the object changed since `obj` was read."""
    metadata = obj.get("metadata") or {}
    others = [r for r in metadata.get("ownerReferences") or [] if not is_node_ref(r)]
    patch: dict[str, Any] = {"ownerReferences": [*others, owner_reference(node, uid)]}
    if metadata.get("resourceVersion"):
        patch["resourceVersion"] = metadata["resourceVersion"]
    return {"metadata": patch}


def node_devices_object(node: dict[str, Any]) -> dict[str, Any]:
    name = node["metadata"]["name"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodeDevices",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": "deviceplane-agent"},
            "ownerReferences": [owner_reference(name, node["metadata"]["uid"])],
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
        plugins_back: RestoredPluginsWait | None = None,
        record: PublishRecord | None = None,
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
        self.plugins_back = plugins_back
        self.record = record or PublishRecord("NodeDevices")
        self.debounce = debounce
        self.heartbeat = heartbeat
        self.max_devices = max_devices
        self.backoff = backoff or Backoff()
        self.node_missing_backoff = Backoff(maximum=NODE_MISSING_RETRY_MAX_SECONDS)
        self.clock = clock
        self.writes = 0
        self._waiting_for_plugins = False
        self._exists = False
        self._written: dict[str, Any] | None = None  # last written status, heartbeat left out
        self._written_at = float("-inf")
        self._allocations_seen: int | None = None
        self._conditions = ConditionTimes()
        self._node_uid: str | None = None  # the Node's, as last read: what the object's ownerReference must name
        self._owners_retry_at = float("-inf")  # after a failed restoration of the ownerReference, not before this
        self._wake = asyncio.Event()

    def changed(self, *_args: object) -> None:
        self._wake.set()

    async def run(self) -> None:
        if self.owners_known is not None:
            await self.owners_known()
        if self.plugins_back is not None and not self.published:
            self._waiting_for_plugins = True
            try:
                await self.plugins_back.wait_restored()
            finally:
                self._waiting_for_plugins = False
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
            model = self.status(self.max_devices)
            status = model.model_dump(mode="json")
            content = without_heartbeat(status)
            if content == self._written and self.clock() - self._written_at < self.heartbeat:
                continue
            last_attempt = self.clock()
            try:
                await self._write(model, status)
            except KubeError as err:
                self.record.failed(err)
                delay = self._retry_delay(err)
                log.warning("cannot publish NodeDevices; retrying", extra={"error": str(err), "retry_in": delay})
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            self.backoff.reset()
            self.node_missing_backoff.reset()
            self._written = content
            self._written_at = self.clock()
            self.record.succeeded()
            self.writes += 1

    def _with_conditions(self, model: DevicesStatus, status: dict[str, Any]) -> dict[str, Any]:
        """`status` with the view's conditions, each keeping the transition time last published (by this agent or
        an earlier one) while its status is unchanged."""
        found = self._conditions.carry(model.conditions)
        return {**status, "conditions": [c.model_dump(mode="json") for c in found]}

    def _retry_delay(self, err: KubeError) -> float:
        return self.node_missing_backoff.delay() if isinstance(err, NodeMissing) else self.backoff.delay()

    async def _write(self, model: DevicesStatus, status: dict[str, Any]) -> None:
        if not self._exists:
            await self._ensure_object()
        try:
            # The published transition times (they move only with a condition's status), added after
            # `_ensure_object`, which recovers an earlier agent's times.
            written = await off_loop(
                self.api.patch_node_devices_status, self.node, self._with_conditions(model, status)
            )
        except KubeError as err:
            if err.status == 404:
                self._exists = False  # deleted meanwhile (its Node re-created, or by hand): create it again
            raise
        if written is not None:  # the object as the API server stored it: its owner checked at no extra request
            await self._keep_owner(written)

    async def _keep_owner(self, obj: dict[str, Any]) -> None:
        """Give the object back its ownerReference to the Node when it lacks it or names another UID (removed or
        edited by hand): without it the object outlives its Node. Checked on the object every status write answers,
        so at the latest at the next heartbeat; the Node is read only to learn its UID (once per start) or when the
        reference is wrong. Best effort: the status was written; a failure is retried a heartbeat later."""
        if self._node_uid is not None and owned_by(obj, self.node, self._node_uid):
            return
        if self.clock() < self._owners_retry_at:
            return
        try:
            node = await off_loop(self.api.get_node, self.node)
            if node is None:  # gone: nothing to own the object (created again, owned, with the next Node)
                self._owners_retry_at = self.clock() + self.heartbeat
                return
            self._node_uid = str(node["metadata"]["uid"])
            if owned_by(obj, self.node, self._node_uid):
                return
            await off_loop(self.api.patch_node_devices, self.node, owners_patch(obj, self.node, self._node_uid))
        except KubeError as err:
            self._owners_retry_at = self.clock() + self.heartbeat
            log.warning(
                "cannot restore the NodeDevices ownerReference to its Node; retrying at a later write",
                extra={"error": str(err), "node": self.node},
            )
            return
        log.info("NodeDevices ownerReference to its Node restored", extra={"node": self.node, "uid": self._node_uid})

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
            self._node_uid = str(node["metadata"]["uid"])
            log.info("NodeDevices created", extra={"node": self.node})
        else:  # a restarted agent: the transition times an earlier one wrote still hold (unless newer ones are known)
            self._conditions.restore(conditions_found(existing))
        self._exists = True

    @property
    def published(self) -> bool:
        """A write has succeeded since start."""
        return self.record.published

    def ready(self) -> str | None:
        waiting = (
            self.plugins_back.restored_problem()
            if self.plugins_back is not None and self._waiting_for_plugins
            else None
        )
        return self.record.not_ready(waiting)
