"""Warning Events on pods whose admission failed, with the reason and message the kubelet would give.

The kubelet rejects a pod its device manager cannot serve with reason `UnexpectedAdmissionError` and the message
`Allocate failed due to <error>, which is unexpected` (pkg/kubelet/cm/admission), or `TopologyAffinityError` from
the topology manager, and records a Warning Event with them. Events are queued (bounded: the oldest are dropped if
the API server is away for long) and sent in order, each retried a few times.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import KubeApi, off_loop
from deviceplane.agent.kube.errors import KubeError
from deviceplane.core.pods import Pod
from deviceplane.core.topology import TOPOLOGY_AFFINITY_ERROR
from deviceplane.core.view import rfc3339

log = logging.getLogger("deviceplane.kube.events")

COMPONENT = "deviceplane-agent"
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"
MAX_QUEUED = 1000
ATTEMPTS = 5


def kubelet_reason(failure: str) -> tuple[str, str]:
    """(reason, message) of the kubelet's rejection for an admission failure as the agent records it."""
    prefix = f"{TOPOLOGY_AFFINITY_ERROR}: "
    if failure.startswith(prefix):
        return TOPOLOGY_AFFINITY_ERROR, failure[len(prefix) :]
    return UNEXPECTED_ADMISSION_ERROR, f"Allocate failed due to {failure}, which is unexpected"


def warning_event(pod: Pod, reason: str, message: str, node: str, now: float) -> dict[str, Any]:
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
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


class AdmissionEvents:
    """An admission-failure observer for pods that came from the API server (`source`)."""

    def __init__(self, api: KubeApi, node: str, source: str = "api", backoff: Backoff | None = None) -> None:
        self.api = api
        self.node = node
        self.source = source
        self.backoff = backoff or Backoff(maximum=10.0)
        self.sent = 0
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_QUEUED)
        self._wake = asyncio.Event()

    def failed(self, source: str, pod: Pod, failure: str) -> None:
        if source != self.source:
            return
        reason, message = kubelet_reason(failure)
        if len(self._queue) == self._queue.maxlen:
            log.warning("event queue full; dropping the oldest", extra={"pod": pod.key})
        self._queue.append(warning_event(pod, reason, message, self.node, time.time()))
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                event = self._queue[0]
                namespace = event["metadata"]["namespace"]
                for attempt in range(1, ATTEMPTS + 1):
                    try:
                        await off_loop(self.api.create_event, namespace, event)
                    except KubeError as err:
                        if attempt == ATTEMPTS or err.status in (403, 404, 422):
                            log.warning("cannot record event; dropped", extra={"error": str(err)})
                            break
                        await asyncio.sleep(self.backoff.delay())
                    else:
                        self.sent += 1
                        break
                self.backoff.reset()
                if self._queue and self._queue[0] is event:
                    self._queue.popleft()
