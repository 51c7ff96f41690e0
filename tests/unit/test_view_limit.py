"""The devices view under a device limit: the first devices in string order, exactly as sorting them all would give,
with `devicesTruncated` saying whether any were left out (a count poll, `limit=0`, lists none)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.api.models import AgentView
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.view import devices_status

R = "example.com/r"
AGENT = AgentView(version="0", node="n", lastHeartbeatTime="x")


def view_ids(ids: list[str], limit: int | None) -> tuple[list[str], bool, int]:
    registry = DeviceRegistry(grace_period=300)
    registry.plugin_connected(R, "/r.sock", PluginOptions(), 0.0)
    registry.apply_snapshot(R, "/r.sock", [Device(i, "Healthy" if n % 2 else "Unhealthy") for n, i in enumerate(ids)])
    (resource,) = devices_status(registry, AGENT, device_limit=limit).resources
    return [d.id for d in resource.devices], resource.devicesTruncated, resource.healthy


ALL = ["a", "b", "c"]


@pytest.mark.parametrize(
    ("limit", "shown", "truncated"),
    [(0, [], True), (2, ["a", "b"], True), (3, ALL, False), (9, ALL, False), (None, ALL, False)],
)
def test_limit_shows_the_first_devices_in_order(limit: int | None, shown: list[str], truncated: bool) -> None:
    ids, was_truncated, healthy = view_ids(["c", "a", "b"], limit)
    assert (ids, was_truncated) == (shown, truncated)
    assert healthy == 1  # counts stay exact whatever the limit


@given(st.lists(st.text(min_size=1, max_size=4), unique=True, max_size=40), st.integers(min_value=0, max_value=45))
def test_limit_agrees_with_sorting_everything(ids: list[str], limit: int) -> None:
    shown, truncated, _healthy = view_ids(ids, limit)
    assert shown == sorted(ids)[:limit]
    assert truncated == (limit < len(ids))
