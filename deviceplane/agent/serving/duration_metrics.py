"""Histograms kept as `core.durations.BucketedDurations` by the parts that time themselves, exposed at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from deviceplane.core.durations import BucketedDurations


class DurationsCollector(Collector):
    """One histogram family; `series` maps each label value tuple to its durations (the series exist from the
    start, at 0)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, ...],
        series: Mapping[tuple[str, ...], BucketedDurations],
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._series = series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for values, durations in self._series.items():
            cumulative, total = durations.cumulative()
            bounds = [repr(float(bound)) for bound in durations.bounds] + ["+Inf"]  # as client_python writes le
            family.add_metric(list(values), buckets=list(zip(bounds, cumulative, strict=True)), sum_value=total)
        yield family
