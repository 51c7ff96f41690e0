"""The device registry (core): upstream manager_test.go cases on capacity, health and per-socket endpoints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.registry import AlreadyConnectedError, Capacity, Device, DeviceRegistry, PluginOptions

GRACE = 300.0
OPTS = PluginOptions()


def devs(*spec: str) -> list[Device]:
    """'D1:H' / 'D2:U' shorthand."""
    return [Device(s.split(":")[0], "Healthy" if s.split(":")[1] == "H" else "Unhealthy") for s in spec]


def sweep(reg: DeviceRegistry, now: float) -> tuple[tuple[str, ...], Capacity]:
    """Upstream GetCapacity: expiry, then the counts."""
    deleted = reg.expire(now)
    return deleted, reg.capacity()


def counts(reg: DeviceRegistry, resource: str, now: float = 0.0) -> tuple[int, int]:
    _deleted, cap = sweep(reg, now)
    return cap.capacity.get(resource, -1), cap.allocatable.get(resource, -1)


def test_capacity_is_a_read() -> None:
    """Counting never deletes: a resource past its grace period stays until expire() runs."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:U"))
    reg.plugin_disconnected("r/x", "/s", now=1)
    assert reg.capacity().capacity == {"r/x": 2} == reg.capacity().capacity
    assert "r/x" in reg
    assert reg.expire(1 + GRACE + 1) == ("r/x",) and reg.capacity().capacity == {}


def test_update_capacity_allocatable() -> None:
    """§6.1 item 6, TestUpdateCapacityAllocatable (minus the checkpoint half, see test_manager_checkpoint)."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("res1", "/s1", OPTS, now=0)
    reg.apply_snapshot("res1", "/s1", devs("D1:H", "D2:H", "D3:U"))
    assert counts(reg, "res1") == (3, 2)
    reg.apply_snapshot("res1", "/s1", devs("D1:H", "D2:H"))
    assert counts(reg, "res1") == (2, 2)
    reg.apply_snapshot("res1", "/s1", devs("D1:H", "D2:U", "D3:H"))
    assert counts(reg, "res1") == (3, 2)
    reg.apply_snapshot("res1", "/s1", devs("D2:U", "D3:U"))
    assert counts(reg, "res1") == (2, 0)
    reg.plugin_connected("res2", "/s2", OPTS, now=0)
    reg.apply_snapshot("res2", "/s2", devs("D1:H", "D2:U", "D3:H"))
    assert set(sweep(reg, 0)[1].capacity) == {"res1", "res2"}
    # e1 disconnected and expired: res1 is deleted from every structure.
    reg.plugin_disconnected("res1", "/s1", now=0)
    deleted, cap = sweep(reg, GRACE + 10)
    assert deleted == ("res1",)
    assert "res1" not in cap.capacity and "res1" not in reg
    # e2 disconnects: stop time set, all its devices unhealthy.
    reg.plugin_disconnected("res2", "/s2", now=1)
    endpoint = reg.primary_endpoint("res2")
    assert endpoint is not None and endpoint.is_stopped and endpoint.stop_time == 1
    assert counts(reg, "res2", 2) == (3, 0)


def test_exact_healthy_string() -> None:
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", [Device("a", "Healthy"), Device("b", "healthy"), Device("c", ""), Device("d", "X")])
    assert reg.healthy_ids("r/x") == {"a"}
    assert counts(reg, "r/x") == (4, 1)


def test_allocatable_devices_multiple_resources() -> None:
    """§6.1 item 7 and 8."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("res1", "/s1", OPTS, 0)
    reg.plugin_connected("res2", "/s2", OPTS, 0)
    reg.apply_snapshot("res1", "/s1", devs("R1D1:H", "R1D2:H", "R1D3:U"))
    reg.apply_snapshot("res2", "/s2", devs("R2D1:H"))
    assert allocatable(reg) == {"res1": ["R1D1", "R1D2"], "res2": ["R2D1"]}
    reg.apply_snapshot("res1", "/s1", devs("R1D1:H", "R1D2:H", "R1D3:H"))
    assert allocatable(reg)["res1"] == ["R1D1", "R1D2", "R1D3"]


def allocatable(reg: DeviceRegistry) -> dict[str, list[str]]:
    """Spec §4.13 GetAllocatableDevices, as PodResources asks it: each resource's healthy devices."""
    return {state.name: [d.id for d in state.allocatable()] for state in reg.statuses()}


def test_endpoint_sync_on_disconnect() -> None:
    """§6.1 item 24 (kubernetes#133702): expiry cleans healthy and unhealthy alike."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H", "c:U"))
    reg.plugin_disconnected("r/x", "/s", now=10)
    state = reg.resource("r/x")
    assert state is not None
    assert state.healthy == set() and state.unhealthy == {"a", "b", "c"}
    assert len(state.all_devices) == 3  # reported devices are untouched (markResourceUnhealthy)
    assert sweep(reg, 10 + GRACE)[1].capacity.get("r/x") == 3  # not yet: strictly greater than the grace period
    deleted, _cap = sweep(reg, 10 + GRACE + 0.001)
    assert deleted == ("r/x",) and reg.statuses() == []


def test_same_resource_same_socket_rejected() -> None:
    """§6.1 item 25."""
    reg = DeviceRegistry(GRACE)
    first = reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    with pytest.raises(AlreadyConnectedError, match=r"device plugin already connected.*/s"):
        reg.plugin_connected("r/x", "/s", PluginOptions(pre_start_required=True), 1)
    assert reg.primary_endpoint("r/x") is first
    assert reg.connected_sockets("r/x") == ["/s"]
    assert counts(reg, "r/x") == (2, 2)


def test_same_resource_different_sockets_coexist() -> None:
    """§6.1 item 26."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s1", OPTS, 0)
    second = reg.plugin_connected("r/x", "/s2", OPTS, 1)
    assert reg.connected_sockets("r/x") == ["/s1", "/s2"]
    assert reg.primary_endpoint("r/x") is second


def test_disconnect_wrong_socket_is_noop() -> None:
    """§6.1 item 27."""
    reg = DeviceRegistry(GRACE)
    endpoint = reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    assert reg.plugin_disconnected("r/x", "/other", 5) is False
    assert reg.plugin_disconnected("r/unknown", "/s", 5) is False
    assert endpoint.stop_time is None
    assert counts(reg, "r/x") == (2, 2)


def test_disconnect_promotes_survivor() -> None:
    """§6.1 item 28, with our improvement: the survivor's own last snapshot is shown at once."""
    reg = DeviceRegistry(GRACE)
    old = reg.plugin_connected("r/x", "/s1", OPTS, 0)
    reg.apply_snapshot("r/x", "/s1", devs("a:H", "b:H"))
    primary = reg.plugin_connected("r/x", "/s2", OPTS, 1)
    reg.apply_snapshot("r/x", "/s2", devs("a:H", "b:H"))
    assert reg.plugin_disconnected("r/x", "/s2", 2)
    assert primary.is_stopped
    assert reg.primary_endpoint("r/x") is old
    assert counts(reg, "r/x") == (2, 2)


def test_survivor_devices_replace_the_dead_primary() -> None:
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s1", OPTS, 0)
    reg.apply_snapshot("r/x", "/s1", devs("old:H"))
    reg.plugin_connected("r/x", "/s2", OPTS, 1)
    reg.apply_snapshot("r/x", "/s2", devs("n1:H", "n2:H"))
    # A snapshot from the non-primary stream is kept but does not clobber the primary's view.
    assert reg.apply_snapshot("r/x", "/s1", devs("old:U")).applied is False
    assert reg.healthy_ids("r/x") == {"n1", "n2"}
    reg.plugin_disconnected("r/x", "/s2", 2)
    assert set(reg.resource("r/x").unhealthy) == {"old"} and reg.healthy_ids("r/x") == set()


def test_last_endpoint_disconnect_marks_unhealthy() -> None:
    """§6.1 item 29."""
    reg = DeviceRegistry(GRACE)
    endpoint = reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    reg.plugin_disconnected("r/x", "/s", 3)
    assert reg.connected_sockets("r/x") == []
    assert endpoint.stop_time == 3
    assert counts(reg, "r/x", 4) == (2, 0)


def test_reregistration_sequence() -> None:
    """§6.1 item 4 at the core level: 2 → 2 → 1 as plugins take over on new sockets."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/p1", OPTS, 0)
    reg.apply_snapshot("r/x", "/p1", devs("Dev1:H", "Dev2:H"))
    assert counts(reg, "r/x") == (2, 2)
    reg.plugin_connected("r/x", "/p2", OPTS, 1)
    reg.apply_snapshot("r/x", "/p2", devs("Dev1:H", "Dev2:H"))
    assert counts(reg, "r/x") == (2, 2)
    reg.plugin_connected("r/x", "/p3", OPTS, 2)
    reg.apply_snapshot("r/x", "/p3", devs("Dev3:H"))
    assert counts(reg, "r/x") == (1, 1)


def test_reconnect_on_same_socket_keeps_devices() -> None:
    reg = DeviceRegistry(GRACE)
    old = reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H"))
    new = reg.plugin_reconnected("r/x", "/s", PluginOptions(pre_start_required=True), 1)
    assert old.is_stopped and not new.is_stopped and reg.primary_endpoint("r/x") is new
    assert counts(reg, "r/x") == (1, 1)


def test_restore_reports_zero_until_plugin_returns() -> None:
    reg = DeviceRegistry(GRACE)
    reg.restore(["r/x", "r/y"], now=100)
    assert counts(reg, "r/x", 100) == (0, 0) and counts(reg, "r/y", 100) == (0, 0)
    reg.plugin_connected("r/x", "/s", OPTS, 101)
    reg.apply_snapshot("r/x", "/s", devs("a:H"))
    deleted, cap = sweep(reg, 100 + GRACE + 1)
    assert deleted == ("r/y",)
    assert cap.capacity == {"r/x": 1}


def test_health_transitions_and_new_devices() -> None:
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    first = reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    assert first.applied and first.transitions == ()
    same = reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    assert same.transitions == ()
    flip = reg.apply_snapshot("r/x", "/s", devs("a:U", "b:H", "c:H"))
    assert flip.transitions == ("a",), "a new device (c) is not a transition"


def test_an_id_sent_twice_flips_once() -> None:
    """Proxy mode takes a snapshot as sent: an ID in it twice is one device, its transition counted once."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H"))
    assert reg.apply_snapshot("r/x", "/s", devs("a:U", "a:U")).transitions == ("a",)


def test_registered_healthy_for_checkpoint() -> None:
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("b:H", "a:H", "c:U"))
    reg.plugin_connected("r/y", "/t", OPTS, 0)
    reg.apply_snapshot("r/y", "/t", devs("z:U"))
    assert reg.registered_healthy() == {"r/x": ["a", "b"], "r/y": []}


def test_registered_healthy_lists_are_shared_until_the_devices_change() -> None:
    """Every checkpoint asks for RegisteredDevices; a resource's sorted list is made once per change of its healthy
    devices and shared until then (the checkpoint's encoder keeps its texts while the list is the same object)."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("b:H", "a:H"))
    first = reg.registered_healthy()["r/x"]
    assert first == ["a", "b"] and reg.registered_healthy()["r/x"] is first
    reg.apply_snapshot("r/x", "/s", devs("b:H", "a:U", "c:H"))
    changed = reg.registered_healthy()["r/x"]
    assert changed == ["b", "c"] and first == ["a", "b"]
    reg.plugin_disconnected("r/x", "/s", 1.0)  # the last endpoint gone: every device unhealthy
    assert reg.registered_healthy() == {"r/x": []}


@given(
    st.lists(
        st.dictionaries(st.sampled_from(["d10", "d2", "d1", "a", "B", "é"]), st.sampled_from(["Healthy", "Unhealthy"])),
        min_size=1,
        max_size=8,
    )
)
def test_the_sorted_ids_follow_every_snapshot_and_are_sorted_once_per_change_of_ids(
    snapshots: list[dict[str, str]],
) -> None:
    """The views list devices by ID from a list sorted once per change of the IDs: it is every shown ID in plain
    string order after each snapshot; a snapshot with the same IDs (a health change, a resend, another order) keeps
    the very list; and it stays so once the plugin is gone."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    (state,) = reg.statuses()
    for shown in snapshots:
        before, ids_before = state.sorted_ids(), set(reg.devices("r/x"))
        reg.apply_snapshot("r/x", "/s", [Device(i, health) for i, health in shown.items()])
        assert state.sorted_ids() == sorted(shown) == sorted(reg.devices("r/x"))
        assert (state.sorted_ids() is before) == (set(shown) == ids_before)
    reg.plugin_disconnected("r/x", "/s", 1.0)
    assert state.sorted_ids() == sorted(snapshots[-1])


def test_an_identical_resend_changes_nothing() -> None:
    """Plugins resend their whole list, often unchanged: the registry keeps its mapping and sets (what the allocator
    and the checkpoint derived from them stays valid) and says nothing changed, so no checkpoint is written."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    assert reg.apply_snapshot("r/x", "/s", devs("a:H", "b:U")).changed
    shown, healthy = reg.devices("r/x"), reg.healthy("r/x")
    again = reg.apply_snapshot("r/x", "/s", devs("a:H", "b:U"))
    assert again.applied and not again.changed and again.transitions == ()
    assert reg.devices("r/x") is shown and reg.healthy("r/x") is healthy
    for different in (
        devs("b:U", "a:H"),
        devs("a:H", "b:H"),
        devs("a:H"),
        [Device("a", "Healthy", (0,)), *devs("b:U")],
    ):
        result = reg.apply_snapshot("r/x", "/s", different)
        assert result.changed and reg.devices("r/x") is not shown, different
        shown = reg.devices("r/x")
    reg.plugin_connected("r/x", "/newer", OPTS, 1)  # the primary now; until its first list, /s's stays shown
    ignored = reg.apply_snapshot("r/x", "/s", devs("z:H"))
    assert not ignored.applied and not ignored.changed and reg.devices("r/x") is shown


def test_a_resend_after_the_resource_was_marked_unhealthy_shows_its_devices_again() -> None:
    """The last plugin gone, every device is unhealthy; the next plugin's first list, identical to the old one's,
    must still make them healthy (the sets no longer match any snapshot)."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H"))
    reg.plugin_disconnected("r/x", "/s", 1.0)
    assert counts(reg, "r/x", 1.0) == (2, 0)
    reg.plugin_connected("r/x", "/s", OPTS, 2.0)
    assert reg.apply_snapshot("r/x", "/s", devs("a:H", "b:H")).changed
    assert counts(reg, "r/x", 2.0) == (2, 2)


@given(st.lists(st.sets(st.integers(0, 150)), min_size=1, max_size=12), st.integers(0, 150))
def test_registered_healthy_stays_sorted_through_any_health_changes(healths: list[set[int]], size: int) -> None:
    """A few devices flipping update the previous sorted list in place of a new sort; many re-sort: either way the
    list is the healthy IDs in order, and a list handed out earlier is never changed."""
    reg = DeviceRegistry(GRACE)
    reg.plugin_connected("r/x", "/s", OPTS, 0)
    ids = [f"d{i}" for i in range(size)]
    handed_out: list[tuple[list[str], list[str]]] = []
    for healthy in healths:
        shown = [Device(d, "Healthy" if i in healthy else "Unhealthy") for i, d in enumerate(ids)]
        reg.apply_snapshot("r/x", "/s", shown)
        listed = reg.registered_healthy()["r/x"]
        assert listed == sorted(d for i, d in enumerate(ids) if i in healthy)
        handed_out.append((listed, list(listed)))
    assert all(listed == copy for listed, copy in handed_out)
