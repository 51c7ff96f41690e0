"""Contract checks of the agent's metrics against DESIGN.md and the README's metrics table."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.core.allocator import AllocationResult
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


def allocation_samples(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.prometheus).decode())}
    return {
        (sample.labels["resource_name"], sample.labels["result"]): sample.value
        for sample in families["deviceplane_allocations"].samples
        if sample.name == "deviceplane_allocations_total"
    }


def test_allocation_results_exist_at_zero_once_a_resource_registers() -> None:
    """The plugin-calls alert takes `increase()` of these series, which cannot see a series' first sample: a failure
    kind first counted in a series made for it (the first timeout of a resource) never fired it."""
    metrics = AgentMetrics(DeviceRegistry(300.0), "node", lambda _resource: 0)
    at_start = {("", "internal"): 0.0, ("<unregistered>", "unregistered"): 0.0}
    assert allocation_samples(metrics) == at_start
    metrics.count_registration("example.com/gpu")
    metrics.count_registration("not a resource name")
    samples = allocation_samples(metrics)
    wanted = {("example.com/gpu", result.value) for result in AllocationResult}
    assert set(samples) == wanted | set(at_start)
    assert all(value == 0.0 for value in samples.values())
    metrics.count_allocation("example.com/gpu", AllocationResult.TIMEOUT)
    assert allocation_samples(metrics)["example.com/gpu", "timeout"] == 1.0


def test_failures_of_resources_nobody_registered_share_one_series() -> None:
    """A pod may name any resource: a series per name it asks for would let pod authors grow the agent's series
    without bound (20 pods asking for 20 random names made 40 series before)."""
    metrics = AgentMetrics(DeviceRegistry(300.0), "node", lambda _resource: 0)
    for i in range(20):
        metrics.count_allocation(f"evil.example/r{i}", AllocationResult.UNREGISTERED)
    metrics.count_allocation("evil.example/r0", AllocationResult.TOPOLOGY)
    samples = allocation_samples(metrics)
    assert not any(resource.startswith("evil.example/") for resource, _result in samples)
    assert samples["<unregistered>", "unregistered"] == 20.0
    assert samples["<unregistered>", "topology"] == 1.0
    metrics.count_registration("evil.example/r0")  # once a plugin registers it, it has its own series
    metrics.count_allocation("evil.example/r0", AllocationResult.UNAVAILABLE)
    assert allocation_samples(metrics)["evil.example/r0", "unavailable"] == 1.0
