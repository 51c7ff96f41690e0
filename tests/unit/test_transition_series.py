"""`deviceplane_device_health_transitions_total` keeps a series only for devices their resource still has: a plugin
that keeps naming new devices and flipping them (buggy or hostile) must not grow the agent's memory or its scrapes
without bound. Driven as the device manager drives it: the registry changed, then the event."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from deviceplane.agent.plugins.contracts import DeviceEvent, DeviceEventKind
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions

NAME = "deviceplane_device_health_transitions"
RESOURCES = ("example.com/a", "example.com/b")


def series(metrics: AgentMetrics) -> dict[tuple[str, str], float]:
    families = text_string_to_metric_families(b"".join(metrics.exposition()).decode())
    found = {}
    for family in families:
        if family.name == NAME:
            for sample in family.samples:
                if sample.name == NAME + "_total":
                    found[sample.labels["resource_name"], sample.labels["device_id"]] = sample.value
    return found


STEPS = st.lists(
    st.tuples(
        st.sampled_from(["snapshot", "snapshot", "snapshot", "disconnect", "expire"]),
        st.sampled_from(RESOURCES),
        st.dictionaries(st.sampled_from([f"d{i}" for i in range(8)]), st.sampled_from(["Healthy", "Unhealthy"])),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(STEPS)
def test_transitions_are_counted_for_present_devices_only(steps: list[tuple[str, str, dict[str, str]]]) -> None:
    registry = DeviceRegistry(300.0)
    metrics = AgentMetrics(registry, "n", lambda _resource: 0)
    counted: dict[tuple[str, str], float] = {}  # the model: flips since the device last (re)appeared
    now = 0.0
    for what, resource, listed in steps:
        now += 1.0
        if resource not in registry or not registry.connected_sockets(resource):
            registry.plugin_connected(resource, "/s", PluginOptions(), now)
            metrics.on_device_event(DeviceEvent(resource, DeviceEventKind.CONNECTED))
        if what == "snapshot":
            result = registry.apply_snapshot(resource, "/s", [Device(i, h) for i, h in listed.items()])
            if result.changed:
                metrics.on_device_event(DeviceEvent(resource, DeviceEventKind.SNAPSHOT, result.transitions))
            for device_id in result.transitions:
                counted[resource, device_id] = counted.get((resource, device_id), 0.0) + 1.0
        elif what == "disconnect":
            registry.plugin_disconnected(resource, "/s", now)
            metrics.on_device_event(DeviceEvent(resource, DeviceEventKind.DISCONNECTED))
        else:
            registry.plugin_disconnected(resource, "/s", now)
            metrics.on_device_event(DeviceEvent(resource, DeviceEventKind.DISCONNECTED))
            now += 301.0
            for deleted in registry.expire(now):
                metrics.on_device_event(DeviceEvent(deleted, DeviceEventKind.DELETED))
        counted = {key: n for key, n in counted.items() if key[1] in registry.devices(key[0])}
        assert series(metrics) == counted
