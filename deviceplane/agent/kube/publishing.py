"""What a publisher's writes came to (Node status, NodeDevices), for /readyz and /metrics.

The composition root gives one record to the publisher, which keeps it, and to the metrics, which read it at scrape
time (serving/publish_metrics.py). Readiness: a publisher is not ready until its first write succeeds, and says
why (the last error, or what its first write waits for). Once it has succeeded it stays ready while later writes
fail: the agent still serves its node (admissions, plugins, PodResources), and a readiness probe failing on every
node at once during an API server outage would only stall DaemonSet rollouts; the failures show in
`deviceplane_publish_failures_total`, the last-publish gauges and the log instead (docs/agent.md, Readiness).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from deviceplane.agent.kube.errors import KubeError

NO_ANSWER = 0  # the status of a request the server never answered (unreachable, timed out, connection broken)


class PublishRecord:
    def __init__(self, what: str, wall_clock: Callable[[], float] = time.time) -> None:
        self.what = what  # as /readyz names it: "node status", "NodeDevices"
        self._wall_clock = wall_clock
        self.published = False  # a write succeeded since start
        self.last_success = 0.0  # Unix time of the last successful write; 0 before the first
        self.last_error: str | None = None  # the last failure while failing; None once a write succeeds
        self.failures: dict[int, int] = {}  # failed attempts by HTTP status (NO_ANSWER when there was none)

    def succeeded(self) -> None:
        self.published = True
        self.last_success = self._wall_clock()
        self.last_error = None

    def failed(self, err: KubeError) -> None:
        self.last_error = str(err)
        # An HTTP status, or NO_ANSWER: the metric's label values stay bounded whatever the error carries.
        code = err.status if 100 <= err.status <= 599 else NO_ANSWER
        self.failures[code] = self.failures.get(code, 0) + 1

    def not_ready(self, waiting: str | None = None) -> str | None:
        """For /readyz: None once a write has succeeded; else why not yet (the last error first, else `waiting`,
        what the first write waits for)."""
        if self.published:
            return None
        why = self.last_error or waiting
        return f"{self.what} not published yet" + (f": {why}" if why else "")
