"""Cluster mode's series: how publishing to the API server goes, read at scrape time from the publishers' records
(kube/publishing.py) and the Event queue's count of dropped events. Registered only with an API server."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NODE_STATUS = "node_status"
NODEDEVICES = "nodedevices"
# The statuses a publish fails with in practice (0: no answer; 401 a token no longer valid, 403 RBAC or the
# node-scoped policy, 404 a Node not there yet, 422 refused by the CRD's schema, 429 throttled, 5xx the API server
# or etcd), made at 0 from the start: `increase()` cannot see the first sample of a series, so a first failure in a
# series made for it would go unseen. Other statuses get their series when they first occur.
USUAL_FAILURE_CODES = (0, 401, 403, 404, 422, 429, 500, 503)


class PublishReading(Protocol):
    """What the metrics read of a publisher's record (kube/publishing.py's `PublishRecord`)."""

    @property
    def last_success(self) -> float: ...

    @property
    def failures(self) -> Mapping[int, int]: ...


class PublishCollector(Collector):
    """`deviceplane_<publisher>_last_publish_timestamp_seconds` per publisher, `deviceplane_publish_failures_total`
    by publisher and status code, and `deviceplane_pod_events_dropped_total` (without Events, in proxy mode: none)."""

    def __init__(
        self, publishers: Mapping[str, PublishReading], events_dropped: Callable[[], int] | None = None
    ) -> None:
        self._publishers = dict(publishers)
        self._events_dropped = events_dropped

    def collect(self) -> Iterator[Metric]:
        for name, record in self._publishers.items():
            yield GaugeMetricFamily(
                f"deviceplane_{name}_last_publish_timestamp_seconds",
                f"Unix time of the last successful {name} write to the API server; 0 before the first.",
                value=record.last_success,
            )
        failures = CounterMetricFamily(
            "deviceplane_publish_failures",
            "Failed attempts to write the Node status or NodeDevices to the API server, by publisher and HTTP status "
            '(code="0": no answer). Each is retried.',
            labels=["publisher", "code"],
        )
        for name, record in self._publishers.items():
            counts = record.failures
            for code in sorted({*USUAL_FAILURE_CODES, *counts}):
                failures.add_metric([name, str(code)], counts.get(code, 0))
        yield failures
        if self._events_dropped is not None:
            yield CounterMetricFamily(
                "deviceplane_pod_events_dropped",
                "Warning Events on pods (failed admissions) dropped: refused by the API server, or pushed out of the "
                "full queue (1,000).",
                value=self._events_dropped(),
            )
