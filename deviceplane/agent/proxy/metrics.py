"""Proxy mode's series, read at scrape time: whether the kubelet's PodResources answers (the device owners shown come
from it), and whether each resource's proxy endpoint is registered with the kubelet."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class PodResourcesReading(Protocol):
    """What the metrics read of the ownership poller (proxy/ownership.py's `Ownership`)."""

    @property
    def reachable(self) -> bool: ...

    @property
    def last_listed(self) -> float: ...


class ProxyCollector(Collector):
    def __init__(
        self,
        node: str,
        pod_resources: PodResourcesReading,
        resources: Callable[[], Iterable[str]],
        kubelet_registered: Callable[[str], bool | None],
    ) -> None:
        self._node = node
        self._pod_resources = pod_resources
        self._resources = resources
        self._kubelet_registered = kubelet_registered

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "deviceplane_kubelet_pod_resources_up",
            "Proxy mode: 1 while the kubelet's PodResources API answered the last poll; 0 before the first answer and "
            "while it does not answer (device owners are then as of the last listing).",
            value=1.0 if self._pod_resources.reachable else 0.0,
        )
        yield GaugeMetricFamily(
            "deviceplane_kubelet_pod_resources_last_list_timestamp_seconds",
            "Proxy mode: Unix time of the last successful listing of the kubelet's PodResources; 0 before the first.",
            value=self._pod_resources.last_listed,
        )
        registered = GaugeMetricFamily(
            "deviceplane_proxy_endpoint_registered",
            "Proxy mode: 1 while the resource's proxy endpoint is registered with the kubelet, 0 while not (the "
            "kubelet restarted, dropped it, or new plugin options wait to be registered).",
            labels=["node", "resource_name"],
        )
        for resource in self._resources():
            state = self._kubelet_registered(resource)
            if state is not None:
                registered.add_metric([self._node, resource], 1.0 if state else 0.0)
        yield registered
