"""Contract checks of the agent's metrics against DESIGN.md and the README's metrics table."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.core.registry import DeviceRegistry

# The kubelet's DevicePluginAllocationDuration uses metrics.DefBuckets (client_golang's prometheus.DefBuckets).
KUBELET_DEF_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def test_alloc_duration_has_the_kubelets_buckets() -> None:
    """README: `deviceplane_device_plugin_alloc_duration_seconds` ... (kubelet buckets); DESIGN: same semantics."""
    metrics = AgentMetrics(DeviceRegistry(300.0), "node", lambda _resource: 0)
    metrics.observe_allocate("example.com/sim", 0.003)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.prometheus).decode())}
    family = families["deviceplane_device_plugin_alloc_duration_seconds"]
    bounds = [
        float(sample.labels["le"])
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf"
    ]
    assert tuple(bounds) == KUBELET_DEF_BUCKETS
