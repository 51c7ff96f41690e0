"""Prometheus metrics of the agent. Device state is read from the registry at scrape time, so a device or resource
that disappears takes its series with it (no stale gauges)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deviceplane import __version__
from deviceplane.agent.plugins.contracts import DeviceEvent
from deviceplane.agent.serving.device_health_text import DeviceHealthText, DeviceTransitions
from deviceplane.agent.serving.duration_metrics import DurationsCollector
from deviceplane.core.allocator import AllocationResult
from deviceplane.core.durations import BucketedDurations
from deviceplane.core.names import is_extended_resource_name
from deviceplane.core.registry import DeviceRegistry

# Bound for hostile registrations: the counter keeps one series for all invalid names.
INVALID_RESOURCE_LABEL = "<invalid>"
# Bound for pod authors: a failure for a resource the agent does not know (any name a pod spec can hold) is counted
# in one series, not one per name.
UNREGISTERED_RESOURCE_LABEL = "<unregistered>"
# A pod's admission: ~1 ms with one Allocate, seconds with the startup wait for plugins, up to PreStart's 30 s.
ADMISSION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ADMISSION_RESULTS = ("admitted", "failed")
# The kubelet's DevicePluginAllocationDuration buckets: component-base's metrics.DefBuckets, which is client_golang's
# prometheus.DefBuckets (prometheus_client's own default adds 0.075, 0.75 and 7.5).
KUBELET_ALLOC_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DeviceStateCollector(Collector):
    def __init__(self, registry: DeviceRegistry, node: str, allocated: Callable[[str], int]) -> None:
        self._registry = registry
        self._node = node
        self._allocated = allocated

    def collect(self) -> Iterator[Metric]:
        # deviceplane_device_health, a series per device, is written as text directly (AgentMetrics.exposition)
        devices = GaugeMetricFamily(
            "deviceplane_devices", "Devices by state.", labels=["node", "resource_name", "state"]
        )
        connected = GaugeMetricFamily(
            "deviceplane_plugin_connected",
            "1 while a device plugin for the resource is connected.",
            labels=["node", "resource_name"],
        )
        for state in self._registry.statuses():
            name = state.name
            devices.add_metric([self._node, name, "healthy"], len(state.healthy))
            devices.add_metric([self._node, name, "unhealthy"], len(state.unhealthy))
            devices.add_metric([self._node, name, "allocated"], self._allocated(name))
            connected.add_metric([self._node, name], 1.0 if state.connected else 0.0)
        tasks = GaugeMetricFamily("deviceplane_agent_asyncio_tasks", "asyncio tasks alive in the agent (leak check).")
        with contextlib.suppress(RuntimeError):  # scraped outside the loop thread: leave it empty
            tasks.add_metric([], len(asyncio.all_tasks()))
        info = GaugeMetricFamily(
            "deviceplane_agent_info",
            "Always 1: the node the agent serves and its version (a rollout's progress: count by version).",
            labels=["node", "version"],
        )
        info.add_metric([self._node, __version__], 1.0)
        yield from (devices, connected, tasks, info)


class AgentMetrics:
    """The agent's Prometheus registry. `on_device_event` is a device listener (health transitions);
    `allocated(resource)` counts the devices held, read at scrape time."""

    def __init__(self, registry: DeviceRegistry, node: str, allocated: Callable[[str], int]) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        self.node = node
        self.registration_total = Counter(
            "deviceplane_device_plugin_registration",
            "Cumulative number of device plugin registrations. Broken down by resource name.",
            ["resource_name"],
            registry=self.prometheus,
        )
        self.alloc_duration = Histogram(
            "deviceplane_device_plugin_alloc_duration_seconds",
            "Duration in seconds to serve a device plugin Allocation request. Broken down by resource name.",
            ["resource_name"],
            buckets=KUBELET_ALLOC_DURATION_BUCKETS,
            registry=self.prometheus,
        )
        self.allocations_total = Counter(
            "deviceplane_allocations",
            "Container allocations by resource and result: success per allocated container resource, or the failure "
            "kind once per failed admission.",
            ["resource_name", "result"],
            registry=self.prometheus,
        )
        self.snapshots_total = Counter(
            "deviceplane_device_plugin_snapshots",
            'ListAndWatch messages applied to a resource\'s devices; changed="false" for one identical to the list '
            "already shown (nothing is rewritten).",
            ["node", "resource_name", "changed"],
            registry=self.prometheus,
        )
        self.prometheus.register(DeviceStateCollector(registry, node, allocated))
        self._registry = registry
        self._allocated = allocated
        # the per-device families, written as text directly (device_health_text.py)
        self._device_health = DeviceHealthText(registry, node)
        self._transitions = DeviceTransitions(node)
        self._admissions: dict[tuple[str, ...], BucketedDurations] = {
            (result,): BucketedDurations(ADMISSION_BUCKETS) for result in ADMISSION_RESULTS
        }
        self.prometheus.register(
            DurationsCollector(
                "deviceplane_pod_admission_duration_seconds",
                "Admission of a pod that requests devices, from its arrival at admission until admitted (durable) or "
                "failed, by result.",
                ("result",),
                self._admissions,
            )
        )
        # Label children by their labels: `labels()` costs a lock and tuple checks per call, twice per admission.
        self._alloc_durations: dict[str, Histogram] = {}
        self._allocation_counts: dict[tuple[str, AllocationResult], Counter] = {}
        self._allocation_count("", AllocationResult.INTERNAL)
        self._allocation_count(UNREGISTERED_RESOURCE_LABEL, AllocationResult.UNREGISTERED)

    def exposition(self) -> tuple[bytes, ...]:
        """What `/metrics` serves, in pieces: every family in the text format, the per-device ones first."""
        return (*self._device_health.pieces(), *self._transitions.pieces(), generate_latest(self.prometheus))

    def observe_admission(self, admitted: bool, seconds: float) -> None:
        self._admissions[("admitted",) if admitted else ("failed",)].observe(seconds)

    def observe_allocate(self, resource: str, seconds: float) -> None:
        child = self._alloc_durations.get(resource)
        if child is None:
            child = self._alloc_durations[resource] = self.alloc_duration.labels(resource)
        child.observe(seconds)

    def count_registration(self, resource: str) -> None:
        """Counted before validation, as upstream: rejected attempts show up too. A valid name's allocation
        results are exported at 0 from then on (`_allocation_count`)."""
        if is_extended_resource_name(resource):
            self.registration_total.labels(resource).inc()
            for result in AllocationResult:  # `internal` too: a PreStart finding no devices held counts it here
                self._allocation_count(resource, result)
        else:
            self.registration_total.labels(INVALID_RESOURCE_LABEL).inc()

    def count_allocation(self, resource: str, result: AllocationResult) -> None:
        """Under the resource's name when a plugin registered it (its series exist from then on), the registry knows
        it (restored from the checkpoint) or a pod holds its devices; else under `<unregistered>`: a pod may name any
        resource."""
        child = self._allocation_counts.get((resource, result))
        if child is None:
            known = resource in self._registry or self._allocated(resource) > 0
            child = self._allocation_count(resource if known else UNREGISTERED_RESOURCE_LABEL, result)
        child.inc()

    def _allocation_count(self, resource: str, result: AllocationResult) -> Counter:
        """The series, created at 0 when first named: `increase()` cannot see a series' first sample, so a failure
        kind first counted in a series made for it would never reach a rate or the plugin-calls alert. A resource's
        results are made when it registers; the agent's own `internal` (no resource) and `<unregistered>`'s
        `unregistered` at start."""
        child = self._allocation_counts.get((resource, result))
        if child is None:
            child = self._allocation_counts[resource, result] = self.allocations_total.labels(resource, result.value)
        return child

    def count_snapshot(self, resource: str, changed: bool) -> None:
        self.snapshots_total.labels(self.node, resource, "true" if changed else "false").inc()

    def on_device_event(self, event: DeviceEvent) -> None:
        self._transitions.count(event.resource, event.transitions)
        # A device the resource no longer has (a list without it, the resource deleted) takes its series with it, as
        # its health gauge does: a plugin that keeps naming new devices must not grow the agent without bound.
        self._transitions.forget_missing(event.resource, self._registry.devices(event.resource))
