"""Counters kept as plain numbers by the objects that count (the journal, the busy-poll window), read at scrape time:
the counting stays an integer or float addition on the hot path, without prometheus_client's locks."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class CounterReader(Collector):
    """One unlabelled counter, `<name>_total`, whose value `read` returns."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


def journal_corrupt_records(read: Callable[[], int]) -> CounterReader:
    """`deviceplane_journal_corrupt_records_total`: invalid journal records found in the middle of a segment at start
    (not a torn tail); their allocations were lost, the valid records after them kept."""
    return CounterReader(
        "deviceplane_journal_corrupt_records",
        "Corrupt allocation-journal records found in the middle of a segment at start (lost, logged as errors).",
        read,
    )


def busy_poll_seconds(read: Callable[[], float]) -> CounterReader:
    """`deviceplane_agent_busy_poll_seconds_total`: the CPU that `--busy-poll` cost (agent/busy_poll.py)."""
    return CounterReader(
        "deviceplane_agent_busy_poll_seconds",
        "Seconds the event loop polled instead of sleeping while one admission alone waited for a plugin RPC "
        "(--busy-poll): the CPU it cost.",
        read,
    )
