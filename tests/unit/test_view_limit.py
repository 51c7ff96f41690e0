"""The devices view under a device limit: a cut list shows the unhealthy devices first, then the held ones, then the
rest, in string order, with `devicesTruncated` saying whether any were left out (a count poll, `limit=0`, lists
none); counts stay exact."""

from __future__ import annotations

from collections.abc import Collection

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.api.models import AgentView, AllocatedTo
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.view import devices_status

R = "example.com/r"
AGENT = AgentView(version="0", node="n", lastHeartbeatTime="x")


class HeldDevices:
    """Holders (core.view) holding the given devices."""

    def __init__(self, held: Collection[str]) -> None:
        self._held = held

    def allocated_count(self, resource: str) -> int:
        return len(self._held)

    def holder(self, resource: str, device_id: str) -> AllocatedTo | None:
        return AllocatedTo(namespace="ns", pod="p", container="c") if device_id in self._held else None

    def held(self, resource: str) -> Collection[str]:
        return self._held


def view_ids(
    ids: list[str], limit: int | None, held: Collection[str] = (), unhealthy: Collection[str] | None = None
) -> tuple[list[str], bool, int]:
    """Every other device unhealthy (the first one, the third, ...) unless `unhealthy` says which."""
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, "/r.sock", PluginOptions(), 0.0)
    sick = set(ids[::2]) if unhealthy is None else set(unhealthy)
    registry.apply_snapshot(R, "/r.sock", [Device(i, "Unhealthy" if i in sick else "Healthy") for i in ids])
    (resource,) = devices_status(registry, AGENT, HeldDevices(held), device_limit=limit).resources
    return [d.id for d in resource.devices], resource.devicesTruncated, resource.healthy


ALL = ["a", "b", "c"]


@pytest.mark.parametrize(
    ("limit", "shown", "truncated"),
    [(0, [], True), (1, ["c"], True), (2, ["b", "c"], True), (3, ALL, False), (9, ALL, False), (None, ALL, False)],
)
def test_a_cut_list_shows_the_unhealthy_devices_first(limit: int | None, shown: list[str], truncated: bool) -> None:
    ids, was_truncated, healthy = view_ids(["c", "a", "b"], limit, held={"b"}, unhealthy={"c"})
    assert (ids, was_truncated) == (shown, truncated)
    assert healthy == 2  # counts stay exact whatever the limit


def test_the_first_ids_alone_would_hide_the_devices_read_for() -> None:
    """An audit: 200 devices, 3 unhealthy (sim-5, sim-150, sim-199), the first 128 IDs listed: sim-5 was left out."""
    ids = [f"sim-{n}" for n in range(200)]
    shown, truncated, healthy = view_ids(ids, 128, held={"sim-7", "sim-99"}, unhealthy={"sim-5", "sim-150", "sim-199"})
    assert truncated and healthy == 197 and len(shown) == 128
    assert {"sim-5", "sim-150", "sim-199", "sim-7", "sim-99"} <= set(shown)
    assert shown == sorted(shown)


@given(
    st.lists(st.text(min_size=1, max_size=4), unique=True, max_size=40),
    st.integers(min_value=0, max_value=45),
    st.data(),
)
def test_limit_agrees_with_ranking_everything(ids: list[str], limit: int, data: st.DataObject) -> None:
    """The same list as ranking every device (unhealthy, then held, then the rest; by ID within each) and keeping the
    first `limit`, shown in ID order."""
    held = data.draw(st.sets(st.sampled_from(ids))) if ids else set()
    shown, truncated, _healthy = view_ids(ids, limit, held)
    sick = set(ids[::2])
    ranked = sorted(ids, key=lambda d: (0 if d in sick else 1 if d in held else 2, d))
    assert shown == sorted(ranked[:limit])
    assert truncated == (limit < len(ids))


def test_a_cut_list_shows_first_an_id_listed_by_a_last_copy_not_healthy() -> None:
    """Proxy mode, an ID sent Healthy then Unhealthy: the kubelet's healthy set has it (every ID is in it, so none
    would look unhealthy by counts), but it is listed Unhealthy (its last copy), so a cut list shows it first."""
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, "/r.sock", PluginOptions(), 0.0)
    sent = [Device("z", "Healthy"), Device("z", "Unhealthy"), Device("a", "Healthy"), Device("b", "Healthy")]
    registry.apply_snapshot(R, "/r.sock", sent)  # as proxy mode takes it (core.snapshot.as_sent: unchanged)
    (resource,) = devices_status(registry, AGENT, HeldDevices({"b"}), device_limit=2).resources
    assert [(d.id, d.health) for d in resource.devices] == [("b", "Healthy"), ("z", "Unhealthy")]
    assert (resource.healthy, resource.unhealthy, resource.devicesTruncated) == (3, 1, True)
