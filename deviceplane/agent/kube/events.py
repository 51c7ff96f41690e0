"""Warning Events on pods whose admission failed, with the reason and message the kubelet would give.

The kubelet rejects a pod its device manager cannot serve with reason `UnexpectedAdmissionError` and the message
`Allocate failed due to <error>, which is unexpected` (pkg/kubelet/cm/admission), or `TopologyAffinityError` from
the topology manager, and records a Warning Event with them. Events are queued and sent in order. An event is retried
with capped backoff for as long as it is queued when the server cannot take it now (unreachable, 429, 5xx: an API
server restart loses nothing), and dropped when the server refuses it (any other 4xx). The queue is bounded: when it
is full the oldest event is dropped (counted and logged), the one being retried included.

A pod's event is named after its UID and reason (`event_name`), so a repeat (the pod refused again after an agent
restart, or admitted again) finds the one already there and raises its `count` and `lastTimestamp`, as the kubelet's
event aggregation does, instead of adding another event with `count: 1`: create, and on 409 AlreadyExists read it
and patch it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from typing import Any

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import KubeApi
from deviceplane.agent.kube.errors import KubeError
from deviceplane.aio import off_loop
from deviceplane.core.pods import Pod
from deviceplane.core.times import rfc3339
from deviceplane.core.topology import TOPOLOGY_AFFINITY_ERROR

log = logging.getLogger("deviceplane.kube.events")

COMPONENT = "deviceplane-agent"
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"
MAX_QUEUED = 1000
TOO_MANY_REQUESTS = 429
CONFLICT = 409
# An Event's name is a DNS subdomain (253 characters): the pod's name, cut to leave room for "." and the digest.
NAME_PREFIX_MAX = 253 - 17


def worth_retrying(err: KubeError) -> bool:
    """The server could not take the event now (unreachable: status 0, 429, 5xx), rather than refused it."""
    return err.status == 0 or err.status == TOO_MANY_REQUESTS or err.status >= 500


def kubelet_reason(failure: str) -> tuple[str, str]:
    """(reason, message) of the kubelet's rejection for an admission failure as the agent records it."""
    prefix = f"{TOPOLOGY_AFFINITY_ERROR}: "
    if failure.startswith(prefix):
        return TOPOLOGY_AFFINITY_ERROR, failure[len(prefix) :]
    return UNEXPECTED_ADMISSION_ERROR, f"Allocate failed due to {failure}, which is unexpected"


def event_name(pod: Pod, reason: str) -> str:
    """The same for every refusal of this pod (its UID: a pod re-created under its name is another) for `reason`,
    across agent restarts. `<pod>.<16 hex digits>`, as the kubelet's `<pod>.<hex time>` reads."""
    digest = hashlib.sha256(f"{pod.uid}\0{reason}".encode()).hexdigest()[:16]
    return f"{pod.name[:NAME_PREFIX_MAX].rstrip('-.')}.{digest}"


def warning_event(pod: Pod, reason: str, message: str, node: str, now: float) -> dict[str, Any]:
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(pod, reason), "namespace": pod.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace, "name": pod.name,
                           "uid": pod.uid},
        "type": "Warning",
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }  # fmt: skip


def record(api: KubeApi, event: dict[str, Any]) -> bool:
    """Create `event`, or count it into the one of its name already there (True). Blocking: run it off the loop.

    Two creates at most: an event can expire (the API server keeps them an hour) between the 409 and the read."""
    metadata = event["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    for _ in range(2):
        try:
            api.create_event(namespace, event)
            return False
        except KubeError as err:
            if err.status != CONFLICT:
                raise
        existing = api.get_event(namespace, name)
        if existing is None:
            continue
        count = existing.get("count")
        patch = {
            "count": (count if isinstance(count, int) and count > 0 else 1) + 1,
            "lastTimestamp": event["lastTimestamp"],
            "message": event["message"],  # the newest refusal's words
        }
        api.patch_event(namespace, name, patch)
        return True
    raise KubeError(f"event {namespace}/{name} exists, then does not: gave up", CONFLICT)


class AdmissionEvents:
    """An admission-failure observer for pods that came from the API server (`source`)."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        source: str = "api",
        backoff: Backoff | None = None,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.api = api
        self.node = node
        self.source = source
        self.backoff = backoff or Backoff(maximum=10.0)
        self.sent = 0
        self.repeats = 0  # of the events sent, those counted into an existing one
        self.dropped = 0  # refused by the server, or pushed out of a full queue
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_queued)
        self._wake = asyncio.Event()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def failed(self, source: str, pod: Pod, failure: str) -> None:
        if source != self.source:
            return
        reason, message = kubelet_reason(failure)
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
            oldest = self._queue[0]["involvedObject"]
            log.warning(
                "event queue full; dropping the oldest",
                extra={"pod": f"{oldest['namespace']}/{oldest['name']}", "dropped": self.dropped},
            )
        self._queue.append(warning_event(pod, reason, message, self.node, time.time()))
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._send(self._queue[0])

    async def _send(self, event: dict[str, Any]) -> None:
        """Send the oldest queued event, retrying while it stays queued; then take it off the queue."""
        while self._queue and self._queue[0] is event:
            try:
                repeat = await off_loop(record, self.api, event)
            except KubeError as err:
                if worth_retrying(err):
                    delay = self.backoff.delay()
                    log.warning("cannot record event; retrying", extra={"error": str(err), "retry_in": delay})
                    await asyncio.sleep(delay)
                    continue
                self.dropped += 1
                log.warning("event refused; dropped", extra={"error": str(err), "dropped": self.dropped})
            else:
                self.sent += 1
                self.repeats += repeat
            self._done(event)
        self.backoff.reset()

    def _done(self, event: dict[str, Any]) -> None:
        if self._queue and self._queue[0] is event:
            self._queue.popleft()
