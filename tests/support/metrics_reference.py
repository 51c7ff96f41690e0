"""`deviceplane_device_health` through prometheus_client's own classes, as the agent wrote it before
serving/device_health_text.py: the reference the direct text must equal (tests/unit/test_device_health_text.py), and
the cost it is measured against (benchmarks/reads.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deviceplane.agent.serving.device_health_text import DOCUMENTATION, LABELS, NAME
from deviceplane.core.registry import DeviceRegistry


class HealthThroughPrometheusClient(Collector):
    """A sample per device, the resources in the registry's order, devices by ID."""

    def __init__(self, registry: DeviceRegistry, node: str) -> None:
        self._registry = registry
        self._node = node

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(NAME, DOCUMENTATION, labels=list(LABELS))
        for state in self._registry.statuses():
            for device_id in sorted(state.all_devices):
                family.add_metric([self._node, state.name, device_id], 1.0 if device_id in state.healthy else 0.0)
        yield family
