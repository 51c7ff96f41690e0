"""The operator's failure counter (docs/operator.md, Metrics): every documented cause is a series from the start, at
0, like `reconcile_total{result}` and `writes_total{kind}`, so the first failure of a cause shows in `increase()`
(the DeviceplaneOperatorReconcileFailing alert) instead of being the series' invisible first sample."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplane.operator.metrics import OperatorMetrics

DOCUMENTED_CAUSES = {"api_error", "conflict", "invalid_spec", "internal"}


def samples(metrics: OperatorMetrics, name: str) -> dict[str, float]:
    families = text_string_to_metric_families(generate_latest(metrics.registry).decode())
    return {next(iter(s.labels.values())): s.value for f in families for s in f.samples if s.name == name and s.labels}


def test_every_failure_cause_exists_at_zero_from_the_start() -> None:
    metrics = OperatorMetrics()
    failures = samples(metrics, "deviceplane_operator_reconcile_failures_total")
    assert failures == dict.fromkeys(DOCUMENTED_CAUSES, 0.0)


def test_results_and_write_kinds_exist_from_the_start_too() -> None:
    metrics = OperatorMetrics()
    assert samples(metrics, "deviceplane_operator_reconcile_total") == dict.fromkeys(
        ("unchanged", "changed", "failed"), 0.0
    )
    assert samples(metrics, "deviceplane_operator_writes_total") == dict.fromkeys(
        ("daemonset_create", "daemonset_update", "status"), 0.0
    )
