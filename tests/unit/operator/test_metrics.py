"""The operator's metrics: `promtool check metrics` clean, configs by condition read at scrape time."""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client import generate_latest

from deviceplane.operator.metrics import OperatorMetrics
from tests.support.required import unavailable


def test_promtool_clean_and_configs_by_condition() -> None:
    statuses = [
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Conflict", "status": "False"}]},
        {"conditions": [{"type": "Ready", "status": "False"}, {"type": "Conflict", "status": "True"}]},
        {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Bogus", "status": "True"}]},
    ]
    metrics = OperatorMetrics()
    metrics.track_configs(lambda: statuses)
    metrics.reconciles.labels("changed").inc()
    metrics.writes.labels("status").inc(2)
    metrics.failures.labels("api_error").inc()
    metrics.duration.observe(0.01)
    text = generate_latest(metrics.registry).decode()
    assert 'deviceplane_operator_configs{condition="Ready",status="True"} 2.0' in text
    assert 'deviceplane_operator_configs{condition="Conflict",status="True"} 1.0' in text
    assert 'deviceplane_operator_writes_total{kind="status"} 2.0' in text
    assert 'deviceplane_operator_writes_total{kind="daemonset_update"} 0.0' in text  # pre-seeded
    assert "Bogus" not in text
    statuses.clear()
    assert (
        'deviceplane_operator_configs{condition="Ready",status="True"} 0.0'
        in generate_latest(metrics.registry).decode()
    )

    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool missing: run `make promtool`")
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
