"""`deviceplane_device_health` written directly (serving/device_health_text.py) against prometheus_client writing the
same family: byte for byte, through random plugin lifecycles, with the per-resource blocks kept between scrapes."""

from __future__ import annotations

from collections.abc import Set
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplane.agent.serving.device_health_text import (
    NAME,
    TRANSITIONS,
    TRANSITIONS_DOCUMENTATION,
    DeviceHealthText,
    DeviceTransitions,
)
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.metrics_reference import HealthThroughPrometheusClient

GRACE = 300.0
RESOURCES = ("example.com/a", "example.com/b", 'x.io/q"uo\\te')
# Device IDs come from plugins unchecked (the kubelet checks none): quotes, backslashes, newlines, any Unicode.
DEVICE_IDS = st.one_of(st.sampled_from(["d1", "d10", "d2", 'q"', "b\\s", "n\nl", "é", "GPU-0"]), st.text(max_size=6))
HEALTH = st.sampled_from(["Healthy", "Unhealthy"])


def joined(text: DeviceHealthText) -> bytes:
    return b"".join(text.pieces())


def reference(registry: DeviceRegistry, node: str) -> bytes:
    theirs = CollectorRegistry(auto_describe=False)
    theirs.register(HealthThroughPrometheusClient(registry, node))
    return generate_latest(theirs)


# One step of a plugin's life: (what, resource index, socket index, the list a snapshot sends).
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["connect", "snapshot", "resend", "disconnect", "expire"]),
        st.integers(0, len(RESOURCES) - 1),
        st.integers(0, 1),
        st.dictionaries(DEVICE_IDS, HEALTH, max_size=6),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(STEPS, st.sampled_from(["node-1", 'we"ird\\node\n']))
def test_the_text_is_prometheus_clients_after_every_change(
    steps: list[tuple[str, int, int, dict[str, str]]], node: str
) -> None:
    """After every connect, list, identical resend, disconnect (devices turn unhealthy) and expiry (the resource and
    its series go), the text equals prometheus_client's for the registry as it is then. A block kept too long (a
    changed health set or ID list not noticed) or a removed resource's block left behind makes them differ."""
    registry = DeviceRegistry(GRACE)
    text = DeviceHealthText(registry, node)
    assert joined(text) == reference(registry, node)  # no resource: the family's HELP and TYPE alone
    now = 0.0
    last: dict[tuple[str, str], dict[str, str]] = {}
    for what, resource_index, socket_index, listed in steps:
        now += 1.0
        resource, socket = RESOURCES[resource_index], f"/s{socket_index}"
        if what == "connect" and socket not in registry.connected_sockets(resource):
            registry.plugin_connected(resource, socket, PluginOptions(), now)
        elif what == "snapshot":
            registry.apply_snapshot(resource, socket, [Device(i, h) for i, h in listed.items()])
            last[resource, socket] = listed
        elif what == "resend" and (resource, socket) in last:
            registry.apply_snapshot(resource, socket, [Device(i, h) for i, h in last[resource, socket].items()])
        elif what == "disconnect":
            registry.plugin_disconnected(resource, socket, now)
        elif what == "expire":
            now += GRACE + 1
            registry.expire(now)
        assert joined(text) == reference(registry, node), (what, resource, socket, listed)
        assert joined(text) == reference(registry, node)  # and again, from the blocks kept


def test_an_unchanged_resource_is_not_written_again() -> None:
    """The point of the blocks: a scrape with nothing changed reuses them, and a health flip rewrites only the
    resource it happened in."""
    registry = DeviceRegistry(GRACE)
    for resource in RESOURCES[:2]:
        registry.plugin_connected(resource, "/s", PluginOptions(), 0.0)
        registry.apply_snapshot(resource, "/s", [Device(f"d{i}", "Healthy") for i in range(100)])
    written: list[str] = []

    class Counting(DeviceHealthText):
        def _block(self, resource: str, ids: list[str], healthy: Set[str]) -> bytes:
            written.append(resource)
            return super()._block(resource, ids, healthy)

    text = Counting(registry, "n")
    first = joined(text)
    assert written == list(RESOURCES[:2])
    assert joined(text) == first and written == list(RESOURCES[:2])
    registry.apply_snapshot(
        RESOURCES[1], "/s", [Device(f"d{i}", "Unhealthy" if i == 7 else "Healthy") for i in range(100)]
    )
    flipped = joined(text)
    assert written == [*RESOURCES[:2], RESOURCES[1]]
    assert flipped == reference(registry, "n") and flipped != first


def test_the_agents_exposition_has_the_family_once_and_parses() -> None:
    """/metrics serves the direct family beside prometheus_client's: one family of that name, every device's sample,
    and the text parses as a whole."""
    registry = DeviceRegistry(GRACE)
    registry.plugin_connected("example.com/a", "/s", PluginOptions(), 0.0)
    registry.apply_snapshot("example.com/a", "/s", [Device("d1", "Healthy"), Device('q"2', "Unhealthy")])
    metrics = AgentMetrics(registry, "node-1", lambda _resource: 0)
    exposition = b"".join(metrics.exposition()).decode()
    assert exposition.count(f"# TYPE {NAME} gauge\n") == 1
    families = {family.name: family for family in text_string_to_metric_families(exposition)}
    health = {sample.labels["device_id"]: sample.value for sample in families[NAME].samples}
    assert health == {"d1": 1.0, 'q"2': 0.0}
    assert "deviceplane_devices" in families and "deviceplane_allocations" in families


# (count: the devices that flipped | forget: the devices the resource still has, resource index)
TRANSITION_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["count", "count", "forget"]),
        st.integers(0, len(RESOURCES) - 1),
        st.lists(DEVICE_IDS, max_size=4),
    ),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(TRANSITION_STEPS, st.sampled_from(["node-1", 'we"ird\\node\n']))
def test_the_transitions_text_is_a_prometheus_client_counters(
    steps: list[tuple[str, int, list[str]]], node: str
) -> None:
    """DeviceTransitions against a prometheus_client Counter driven alike (`remove` for a device forgotten), with one
    fake clock for both `_created`: byte for byte after every step, and again from the text kept."""
    ticks = iter(range(1_764_000_000, 1_800_000_000, 7))
    now = [0.0]
    ours = DeviceTransitions(node, clock=lambda: now[0])
    theirs = CollectorRegistry(auto_describe=False)
    counter = Counter(TRANSITIONS, TRANSITIONS_DOCUMENTATION, ["node", "resource_name", "device_id"], registry=theirs)
    children: dict[str, set[str]] = {}
    with patch("prometheus_client.metrics.time.time", lambda: now[0]):
        for what, index, device_ids in steps:
            resource = RESOURCES[index]
            if what == "count":
                for device_id in device_ids:
                    if device_id not in children.setdefault(resource, set()):
                        now[0] = next(ticks) + 0.123456  # a new series: its _created, for both
                        children[resource].add(device_id)
                    counter.labels(node, resource, device_id).inc()
                    ours.count(resource, [device_id])
            else:
                for device_id in [d for d in children.get(resource, set()) if d not in device_ids]:
                    counter.remove(node, resource, device_id)
                    children[resource].discard(device_id)
                ours.forget_missing(resource, set(device_ids))
            assert b"".join(ours.pieces()) == generate_latest(theirs), (what, resource, device_ids)
            assert b"".join(ours.pieces()) == generate_latest(theirs)
