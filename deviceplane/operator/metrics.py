"""Prometheus metrics of the operator (DESIGN: reconcile totals, durations, failures, configs by condition).

Configs by condition are read from the reconciler's last computed statuses at scrape time: a deleted config takes
its series with it. `deviceplane_operator_writes_total` counts every mutating request, so "no write at rest" is
observable in production too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Conflict")
RESULTS = ("unchanged", "changed", "failed")
WRITE_KINDS = ("daemonset_create", "daemonset_update", "status")
FAILURE_CAUSES = ("api_error", "conflict", "invalid_spec", "internal")


class ConfigsCollector(Collector):
    def __init__(self, statuses: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "deviceplane_operator_configs",
            "DevicePluginConfigs by condition type and status, as last reconciled.",
            labels=["condition", "status"],
        )
        counts = {(c, s): 0 for c in CONDITION_TYPES for s in ("True", "False", "Unknown")}
        for status in self._statuses():
            for cond in status.get("conditions") or []:
                pair = (cond.get("type"), cond.get("status"))
                if pair in counts:
                    counts[pair] += 1
        for (condition, value), n in sorted(counts.items()):
            family.add_metric([condition, value], n)
        yield family


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconciles = Counter(
            "deviceplane_operator_reconcile",
            "Reconciliations of a DevicePluginConfig by result: unchanged (no write), changed, failed.",
            ["result"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "deviceplane_operator_reconcile_duration_seconds",
            "Time to reconcile one DevicePluginConfig, API requests included.",
            registry=self.registry,
        )
        self.writes = Counter(
            "deviceplane_operator_writes",
            "Mutating API requests the operator sent, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.failures = Counter(
            "deviceplane_operator_reconcile_failures",
            f"Failed reconciliations by cause (bounded: {', '.join(FAILURE_CAUSES)}).",
            ["cause"],
            registry=self.registry,
        )
        for result in RESULTS:
            self.reconciles.labels(result)
        for kind in WRITE_KINDS:
            self.writes.labels(kind)
        # Every cause at 0 from the start: `increase()` cannot see a series' first sample, so a cause counted once
        # (a refused spec is final until the config changes) would otherwise never show in rates or alerts.
        for cause in FAILURE_CAUSES:
            self.failures.labels(cause)

    def track_configs(self, statuses: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        """Export configs by condition from `statuses` (the reconciler's last computed ones) at scrape time."""
        self.registry.register(ConfigsCollector(statuses))
