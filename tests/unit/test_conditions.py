"""The devices view's conditions (core/conditions.py): judged from the resources (and in proxy mode from the kubelet's
PodResources), their lastTransitionTime moving only when their status does; `/api/v1/devices` (ApiViews) serves them
as NodeDevices does, over every resource."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.agent.serving.api_views import ApiViews
from deviceplane.api.models import Condition
from deviceplane.core.conditions import (
    ConditionTimes,
    PodResourcesLink,
    ResourceCounts,
    conditions,
    devices_healthy,
    keep_times,
    owners_current,
    plugins_connected,
)
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodTable
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from deviceplane.core.times import rfc3339
from deviceplane.core.view import resource_counts

GPU, NIC = "example.com/gpu", "example.com/nic"


def registry_with(*resources: tuple[str, list[str]]) -> DeviceRegistry:
    """One connected plugin per resource, with devices of the given health."""
    registry = DeviceRegistry(grace_period=300)
    for name, healths in resources:
        socket = f"/{name.replace('/', '-')}.sock"
        registry.plugin_connected(name, socket, PluginOptions(), 0.0)
        registry.apply_snapshot(name, socket, [Device(f"d{i}", h) for i, h in enumerate(healths)])
    return registry


def resources_of(registry: DeviceRegistry) -> list[ResourceCounts]:
    counts = [resource_counts(state) for state in registry.statuses()]
    # the counts are the registry's own (its capacity(), which the Node gets) and its connection state, exact also
    # where a view's device lists are truncated
    capacity = registry.capacity()
    assert [(c.name, c.capacity, c.healthy) for c in counts] == [
        (name, capacity.capacity[name], capacity.allocatable[name]) for name in sorted(capacity.capacity)
    ]
    for c in counts:
        state = registry.resource(c.name)
        assert state is not None and (c.connected, c.unhealthy) == (state.connected, len(state.unhealthy))
    return counts


def by_type(found: list[Condition]) -> dict[str, tuple[str, str, str, str]]:
    return {c.type: (c.status, c.reason, c.message, c.lastTransitionTime) for c in found}


def test_judgements_name_the_resources_concerned() -> None:
    registry = registry_with((GPU, ["Healthy", "Unhealthy"]), (NIC, ["Healthy"]))
    assert plugins_connected(resources_of(registry)) == ("True", "AllConnected", "2 of 2 plugins connected")
    assert devices_healthy(resources_of(registry)) == ("False", "UnhealthyDevices", f"{GPU}: 1 of 2 unhealthy")

    registry.plugin_disconnected(NIC, "/example.com-nic.sock", 1.0)  # its devices turn unhealthy (effective health)
    assert plugins_connected(resources_of(registry)) == ("False", "PluginDisconnected", f"not connected: {NIC}")
    assert devices_healthy(resources_of(registry)) == (
        "False", "UnhealthyDevices", f"{GPU}: 1 of 2 unhealthy; {NIC}: 1 of 1 unhealthy",
    )  # fmt: skip
    assert by_type(conditions([], "t0", {})) == {
        "PluginsConnected": ("True", "AllConnected", "0 of 0 plugins connected", "t0"),
        "DevicesHealthy": ("True", "AllHealthy", "0 devices healthy", "t0"),
    }


def test_transition_time_moves_only_with_the_status() -> None:
    registry = registry_with((GPU, ["Healthy", "Healthy"]))
    times = ConditionTimes()
    assert {t: c[3] for t, c in by_type(times.update(resources_of(registry), "t1")).items()} == {
        "PluginsConnected": "t1", "DevicesHealthy": "t1",
    }  # fmt: skip

    registry.apply_snapshot(GPU, "/example.com-gpu.sock", [Device("d0", "Healthy"), Device("d1", "Unhealthy")])
    found = by_type(times.update(resources_of(registry), "t2"))
    assert found["DevicesHealthy"] == ("False", "UnhealthyDevices", f"{GPU}: 1 of 2 unhealthy", "t2")
    assert found["PluginsConnected"][3] == "t1"  # unchanged status: its time kept

    registry.apply_snapshot(GPU, "/example.com-gpu.sock", [Device("d0", "Unhealthy"), Device("d1", "Unhealthy")])
    found = by_type(times.update(resources_of(registry), "t3"))
    assert found["DevicesHealthy"] == ("False", "UnhealthyDevices", f"{GPU}: 2 of 2 unhealthy", "t2")  # message only

    registry.apply_snapshot(GPU, "/example.com-gpu.sock", [Device("d0", "Healthy"), Device("d1", "Healthy")])
    assert by_type(times.update(resources_of(registry), "t4"))["DevicesHealthy"][3] == "t4"


def test_restored_times_hold_where_the_status_does_and_never_replace_newer_ones() -> None:
    earlier = [
        Condition(type="PluginsConnected", status="True", reason="r", message="m", lastTransitionTime="t0"),
        Condition(type="DevicesHealthy", status="False", reason="r", message="m", lastTransitionTime="t0"),
        Condition(type="SomethingElse", status="True", reason="r", message="m", lastTransitionTime="t0"),
    ]
    resources = resources_of(registry_with((GPU, ["Healthy"])))
    times = ConditionTimes()
    times.restore(earlier)
    found = by_type(times.update(resources, "t1"))
    assert {t: c[3] for t, c in found.items()} == {"PluginsConnected": "t0", "DevicesHealthy": "t1"}

    times.restore([c.model_copy(update={"lastTransitionTime": "t-1"}) for c in earlier])  # ignored: t1 is newer
    assert by_type(times.update(resources, "t2"))["DevicesHealthy"][3] == "t1"


def test_times_carried_over_conditions_judged_elsewhere() -> None:
    """The NodeDevices publisher keeps the times it last published (or an earlier agent did) over the view's."""
    resources = resources_of(registry_with((GPU, ["Healthy"])))
    times = ConditionTimes()
    times.restore(conditions(resources, "t0", {}))
    assert {c.lastTransitionTime for c in times.carry(conditions(resources, "t1", {}))} == {"t0"}
    registry = registry_with((GPU, ["Unhealthy"]))
    carried = by_type(times.carry(conditions(resources_of(registry), "t2", {})))
    assert (carried["PluginsConnected"][3], carried["DevicesHealthy"][3]) == ("t0", "t2")
    assert keep_times([], {}) == []


def test_api_devices_reports_the_node_conditions_also_for_one_resource() -> None:
    """/api/v1/devices: the same conditions as NodeDevices, over every resource even under `?resource=` (which must
    not flip them either), and their times kept from one request to the next."""
    registry = registry_with((GPU, ["Healthy"]), (NIC, ["Unhealthy"]))
    now = [1_000_000.0]
    views = ApiViews(registry, PodTable(), PodDevices(), "n", wall_clock=lambda: now[0])

    first = json.loads(views.devices())["conditions"]
    assert [(c["type"], c["status"], c["message"]) for c in first] == [
        ("PluginsConnected", "True", "2 of 2 plugins connected"),
        ("DevicesHealthy", "False", f"{NIC}: 1 of 1 unhealthy"),
    ]
    now[0] += 5
    only_gpu = json.loads(views.devices({"resource": GPU}))
    assert [r["name"] for r in only_gpu["resources"]] == [GPU]
    assert only_gpu["conditions"] == first  # node-wide, times kept
    registry.plugin_disconnected(GPU, "/example.com-gpu.sock", 2.0)
    now[0] += 5
    connected = json.loads(views.devices())["conditions"][0]
    assert (connected["status"], connected["lastTransitionTime"]) == ("False", rfc3339(now[0]))
    assert first[0]["lastTransitionTime"] == rfc3339(now[0] - 10)
    healthy = json.loads(views.devices())["conditions"][1]  # still False: its time kept, its message says more
    assert (healthy["status"], healthy["lastTransitionTime"]) == ("False", first[1]["lastTransitionTime"])
    assert healthy["message"] == f"{GPU}: 1 of 1 unhealthy; {NIC}: 1 of 1 unhealthy"


# ---- OwnersCurrent (proxy mode): the kubelet's PodResources ------------------------------------------------------

LISTED = PodResourcesLink(last_listed=1_800_000_000.0, lost_since=None, error=None)
UNIX_TIMES = st.floats(min_value=0, max_value=4_000_000_000, allow_nan=False)
links = st.builds(
    PodResourcesLink,
    last_listed=st.none() | UNIX_TIMES,
    lost_since=st.none() | UNIX_TIMES,
    error=st.none() | st.text(min_size=1, max_size=40),
)


@given(links)
def test_owners_are_current_only_while_listed_and_no_poll_failed_since(link: PodResourcesLink) -> None:
    status, reason, message = owners_current(link)
    assert (status == "True") is (link.last_listed is not None and link.lost_since is None)
    if link.last_listed is None:
        assert (status, reason) == ("False", "PodResourcesNotListed") and "no device owners known" in message
    elif link.lost_since is not None:
        # since when (a time, not a count of seconds that would change the message each second), why, and how old
        assert (status, reason) == ("False", "PodResourcesUnreachable")
        assert message.startswith(f"kubelet PodResources unreachable since {rfc3339(link.lost_since)}")
        assert message.endswith(f"device owners are as of {rfc3339(link.last_listed)}")
    if status == "False" and link.error:
        assert f"({link.error})" in message


def test_unreachable_message_reads_like_the_log_line() -> None:
    link = PodResourcesLink(1_800_000_000.0, 1_800_000_090.0, "UNAVAILABLE: failed to connect to all addresses")
    assert owners_current(link) == (
        "False",
        "PodResourcesUnreachable",
        "kubelet PodResources unreachable since 2027-01-15T08:01:30Z (UNAVAILABLE: failed to connect to all "
        "addresses): device owners are as of 2027-01-15T08:00:00Z",
    )
    assert owners_current(LISTED) == (
        "True", "PodResourcesListed", "kubelet PodResources answering: device owners as it last listed them",
    )  # fmt: skip


def test_owners_current_is_absent_in_agent_mode() -> None:
    """Agent mode judges no link (the agent allocates: its owners are current by construction)."""
    resources = resources_of(registry_with((GPU, ["Healthy"])))
    assert [c.type for c in conditions(resources, "t0", {})] == ["PluginsConnected", "DevicesHealthy"]
    assert [c.type for c in conditions(resources, "t0", {}, LISTED)] == [
        "PluginsConnected", "DevicesHealthy", "OwnersCurrent",
    ]  # fmt: skip


@given(st.lists(st.sampled_from(["listed", "lost", "lost-later", "not-listed"]), min_size=1, max_size=12))
def test_owners_current_time_moves_only_with_its_status(states: list[str]) -> None:
    """Whatever the sequence of polls, OwnersCurrent's lastTransitionTime is the time of its last status change, its
    message follows the link, and the resource conditions' times stay where they were."""
    resources = resources_of(registry_with((GPU, ["Healthy"])))
    times = ConditionTimes()
    by_state = {
        "listed": LISTED,
        "lost": PodResourcesLink(1_800_000_000.0, 1_800_000_001.0, "UNAVAILABLE"),
        "lost-later": PodResourcesLink(1_800_000_000.0, 1_800_000_007.0, "DEADLINE_EXCEEDED"),
        "not-listed": PodResourcesLink(None, None, None),
    }
    changed_at = None
    last_status = None
    for i, state in enumerate(states):
        found = by_type(times.update(resources, f"t{i}", by_state[state]))
        status, reason, message = owners_current(by_state[state])
        if status != last_status:
            changed_at, last_status = f"t{i}", status
        assert found["OwnersCurrent"] == (status, reason, message, changed_at)
        assert found["PluginsConnected"][3] == found["DevicesHealthy"][3] == "t0"


def test_owners_current_time_is_restored_from_an_earlier_agent() -> None:
    """NodeDevices keeps it across agent restarts as the others: an earlier agent's time holds while the status does."""
    resources = resources_of(registry_with((GPU, ["Healthy"])))
    times = ConditionTimes()
    times.restore(conditions(resources, "t0", {}, LISTED))
    assert {c.type: c.lastTransitionTime for c in times.update(resources, "t1", LISTED)}["OwnersCurrent"] == "t0"
    times = ConditionTimes()
    times.restore(conditions(resources, "t0", {}, PodResourcesLink(1.0, 2.0, "UNAVAILABLE")))
    assert {c.type: c.lastTransitionTime for c in times.update(resources, "t1", LISTED)}["OwnersCurrent"] == "t1"


def test_api_devices_reports_owners_current_in_proxy_mode_only() -> None:
    registry = registry_with((GPU, ["Healthy"]))
    now = [1_800_000_100.0]
    link = [LISTED]
    proxied = ApiViews(
        registry, PodTable(), PodDevices(), "n", wall_clock=lambda: now[0], pod_resources=lambda: link[0]
    )
    owners = json.loads(proxied.devices({"resource": GPU}))["conditions"][2]  # node-wide also under ?resource=
    assert (owners["type"], owners["status"]) == ("OwnersCurrent", "True")
    assert owners["lastTransitionTime"] == rfc3339(now[0])
    link[0] = PodResourcesLink(LISTED.last_listed, 1_800_000_105.0, "UNAVAILABLE")
    now[0] += 10
    owners = json.loads(proxied.devices())["conditions"][2]
    assert (owners["status"], owners["reason"]) == ("False", "PodResourcesUnreachable")
    assert owners["lastTransitionTime"] == rfc3339(now[0])

    standalone = ApiViews(registry, PodTable(), PodDevices(), "n", wall_clock=lambda: now[0])
    assert [c["type"] for c in json.loads(standalone.devices())["conditions"]] == ["PluginsConnected", "DevicesHealthy"]
