"""Metrics of the durable state, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class JournalCorruptionCollector(Collector):
    """`deviceplane_journal_corrupt_records_total`: invalid journal records found in the middle of a segment at start
    (not a torn tail); their allocations were lost, the valid records after them kept."""

    def __init__(self, corrupt_records: Callable[[], int]) -> None:
        self._corrupt_records = corrupt_records

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "deviceplane_journal_corrupt_records",
            "Corrupt allocation-journal records found in the middle of a segment at start (lost, logged as errors).",
            value=self._corrupt_records(),
        )
