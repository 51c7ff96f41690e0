"""Registration with the agent over real sockets, with real plugin processes (spec §4.2-4.5, §6.1, §6.2)."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplane.core.checkpoint import decode
from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/res"
TWO = [["Dev1", "Healthy"], ["Dev2", "Healthy"]]


def test_register_shows_devices_and_options(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> None:
    plugin = plugin_factory(
        agent.plugin_dir, "p1.sock", [["a", "Healthy", [0]], ["b", "Unhealthy", [1]]], "--pre-start"
    )
    assert plugin.register(R) == {"ok": True}
    wait_for(lambda: agent.counts(R) == (2, 1), what="first snapshot applied")
    res = agent.resource(R)
    assert (res["capacity"], res["allocatable"], res["healthy"], res["unhealthy"]) == (2, 1, 1, 1)
    assert res["plugin"]["connected"] is True
    assert res["plugin"]["endpoint"] == str(agent.plugin_dir / "p1.sock")
    # Options come from GetDevicePluginOptions, not from the RegisterRequest (which carried none).
    assert res["plugin"]["preStartRequired"] is True and res["plugin"]["getPreferredAllocationAvailable"] is False
    assert [(d["id"], d["health"], d["numaNodes"]) for d in res["devices"]] == [
        ("a", "Healthy", [0]),
        ("b", "Unhealthy", [1]),
    ]
    # Upstream's order of calls to the plugin: the options, then (after the dial answered Register) the stream.
    assert plugin.send(cmd="calls")["order"] == ["GetDevicePluginOptions", "ListAndWatch"]


def test_refused_list_and_watch_registers_then_disconnects(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """As upstream, Register answers once the options are in; the stream's refusal then disconnects the plugin."""
    plugin = plugin_factory(agent.plugin_dir, "p.sock", TWO, "--refuse-stream")
    assert plugin.register(R) == {"ok": True}
    res = wait_for(lambda: (r := agent.resource(R)) and not r["plugin"]["connected"] and r, what="disconnected")
    assert (res["capacity"], res["allocatable"]) == (0, 0), "no list was ever received"
    assert plugin.send(cmd="calls")["order"] == ["GetDevicePluginOptions", "ListAndWatch"]
    assert agent.metric("deviceplane_plugin_connected", resource_name=R) == 0.0
    good = plugin_factory(agent.plugin_dir, "good.sock", TWO)
    assert good.register(R) == {"ok": True}
    wait_for(lambda: agent.counts(R) == (2, 2), what="a working plugin for the same resource still registers")


def test_registration_server_dir_and_stale_sockets(short_tmp: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(plugin_dir / "stale.sock"))
    stale.close()
    (plugin_dir / "notes.txt").write_text("kept")
    (plugin_dir / "subdir").mkdir()
    agent = agent_factory()
    assert not (plugin_dir / "stale.sock").exists()
    assert (plugin_dir / "notes.txt").read_text() == "kept" and (plugin_dir / "subdir").is_dir()
    assert stat.S_ISSOCK(os.stat(plugin_dir / "kubelet.sock").st_mode)
    agent.stop()
    assert not (plugin_dir / "kubelet.sock").exists(), "clean shutdown removes the registration socket"


def test_fresh_dir_created_0750(short_tmp: Path, agent_factory: Callable[..., AgentProcess]) -> None:
    agent_factory()
    assert stat.S_IMODE(os.stat(short_tmp / "dp").st_mode) == 0o750


@pytest.mark.parametrize("flags", [(), ("--pre-start",), ("--preferred",), ("--pre-start", "--preferred")])
def test_device_plugin_reregistration(
    flags: tuple[str, ...], agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """§6.1 item 4: p1 (2 devices) → p2 same devices on another socket → p3 (1 device): 2 → 2 → 1."""
    p1 = plugin_factory(agent.plugin_dir, "p.sock", TWO, *flags)
    assert p1.register(R)["ok"]
    wait_for(lambda: agent.counts(R) == (2, 2), what="2/2 after p1")
    p2 = plugin_factory(agent.plugin_dir, "p.sock.new", TWO, *flags)
    assert p2.register(R)["ok"]
    wait_for(lambda: agent.resource(R)["plugin"]["endpoint"].endswith("p.sock.new"), what="p2 primary")
    assert agent.counts(R) == (2, 2)
    p3 = plugin_factory(agent.plugin_dir, "p.sock.third", [["Dev3", "Healthy"]], *flags)
    assert p3.register(R)["ok"]
    wait_for(lambda: agent.counts(R) == (1, 1), what="1/1 after p3")
    res = agent.resource(R)
    assert res["plugin"]["preStartRequired"] == ("--pre-start" in flags)
    assert res["plugin"]["getPreferredAllocationAvailable"] == ("--preferred" in flags)
    # The old plugins' streams ending never disconnects the newest one (kubernetes#121994).
    p1.stop()
    p2.stop()
    time.sleep(0.3)
    assert agent.counts(R) == (1, 1) and agent.resource(R)["plugin"]["connected"]


def test_listandwatch_updates_are_full_snapshots(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """§6.2 TestRun: each message replaces the device list."""
    plugin = plugin_factory(
        agent.plugin_dir,
        "p.sock",
        [["ADeviceId", "Healthy"], ["AnotherDeviceId", "Healthy"], ["AThirdDeviceId", "Unhealthy"]],
    )
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (3, 2), what="initial snapshot")
    plugin.devices([["ADeviceId", "Unhealthy"], ["AThirdDeviceId", "Healthy"], ["AFourthDeviceId", "Healthy"]])
    wait_for(
        lambda: (
            {d["id"]: d["health"] for d in agent.resource(R)["devices"]}
            == {"ADeviceId": "Unhealthy", "AThirdDeviceId": "Healthy", "AFourthDeviceId": "Healthy"}
        ),
        what="second snapshot replaced the list",
    )
    assert agent.metric("deviceplane_device_health_transitions_total", device_id="ADeviceId") == 1.0
    assert agent.metric("deviceplane_device_health_transitions_total", device_id="AThirdDeviceId") == 1.0


def test_identical_snapshots_are_counted_and_write_no_checkpoint(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    """A plugin resending its unchanged list: the agent counts each message but rebuilds and rewrites nothing (the
    kubelet writes its checkpoint again for every one); the next real change is written as usual."""
    shown = [["a", "Healthy"], ["b", "Unhealthy"]]
    plugin = plugin_factory(agent.plugin_dir, "p.sock", shown)
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (2, 1), what="initial snapshot")
    checkpoint = agent.plugin_dir / "kubelet_internal_checkpoint"

    def registered() -> dict[str, list[str]] | None:
        return decode(checkpoint.read_bytes()).RegisteredDevices if checkpoint.exists() else None

    wait_for(lambda: registered() == {R: ["a"]}, what="the first snapshot written")
    written = checkpoint.stat()

    def snapshots(changed: str) -> float:
        return agent.metric("deviceplane_device_plugin_snapshots_total", resource_name=R, changed=changed) or 0.0

    changed_before = snapshots("true")
    for _ in range(3):
        plugin.devices(shown)
    wait_for(lambda: snapshots("false") == 3.0, what="three identical snapshots applied")
    after = checkpoint.stat()
    assert (after.st_ino, after.st_mtime_ns) == (written.st_ino, written.st_mtime_ns), "checkpoint rewritten"
    assert snapshots("true") == changed_before
    plugin.devices([["a", "Healthy"], ["b", "Healthy"]])
    wait_for(lambda: agent.counts(R) == (2, 2), what="the changed snapshot")
    wait_for(lambda: registered() == {R: ["a", "b"]}, what="the change written to the checkpoint")
    assert snapshots("true") == changed_before + 1 and snapshots("false") == 3.0


def test_disconnect_then_grace_period_deletes(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    """Disconnect: capacity stays, allocatable 0, plugin not connected; after --grace-period it is deleted."""
    agent = agent_factory("--grace-period", "2s")
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["a", "Healthy"], ["b", "Healthy"], ["c", "Unhealthy"]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (3, 2), what="registered")
    plugin.stop()
    res = wait_for(lambda: (r := agent.resource(R)) and not r["plugin"]["connected"] and r, what="disconnected")
    assert (res["capacity"], res["allocatable"], res["healthy"], res["unhealthy"]) == (3, 0, 0, 3)
    assert agent.metric("deviceplane_plugin_connected", resource_name=R) == 0.0
    wait_for(lambda: agent.resource(R) is None, timeout=6, what="resource deleted after grace period")
    assert agent.metric("deviceplane_devices", resource_name=R, state="healthy") is None


def test_stale_stream_end_does_not_disconnect_newer_plugin(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    old = plugin_factory(agent.plugin_dir, "old.sock", TWO)
    old.register(R)
    wait_for(lambda: agent.counts(R) == (2, 2))
    new = plugin_factory(agent.plugin_dir, "new.sock", [["Dev3", "Healthy"]])
    new.register(R)
    wait_for(lambda: agent.counts(R) == (1, 1))
    assert old.send(cmd="end-streams")["ok"]
    time.sleep(0.3)
    res = agent.resource(R)
    assert res["plugin"]["connected"] and res["plugin"]["endpoint"].endswith("new.sock")
    assert agent.counts(R) == (1, 1)
    # The survivor's death with the old one gone: last endpoint, resource unhealthy.
    new.stop()
    wait_for(lambda: agent.counts(R) == (1, 0), what="last endpoint disconnected")


def test_primary_death_promotes_survivor_with_its_devices(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    survivor = plugin_factory(agent.plugin_dir, "a.sock", TWO)
    survivor.register(R)
    wait_for(lambda: agent.counts(R) == (2, 2))
    primary = plugin_factory(agent.plugin_dir, "b.sock", [["Dev3", "Healthy"]])
    primary.register(R)
    wait_for(lambda: agent.counts(R) == (1, 1))
    primary.stop()
    wait_for(lambda: agent.counts(R) == (2, 2), what="survivor promoted, its devices shown")
    assert agent.resource(R)["plugin"]["endpoint"].endswith("a.sock")


def test_plugin_restart_on_same_socket(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> None:
    """Most plugins restart on a fixed socket name: the new instance must take over, never be locked out."""
    first = plugin_factory(agent.plugin_dir, "fixed.sock", TWO)
    first.register(R)
    wait_for(lambda: agent.counts(R) == (2, 2))
    first.stop()
    os.unlink(agent.plugin_dir / "fixed.sock")
    second = plugin_factory(
        agent.plugin_dir, "fixed.sock", [["Dev1", "Healthy"], ["Dev2", "Healthy"], ["Dev9", "Healthy"]]
    )
    assert second.register(R)["ok"]
    wait_for(lambda: agent.counts(R) == (3, 3), what="restarted plugin's devices")
    time.sleep(0.3)
    res = agent.resource(R)
    assert res["plugin"]["connected"] and agent.counts(R) == (3, 3)


def test_same_socket_registered_twice_replaces_connection(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", TWO)
    assert plugin.register(R)["ok"]
    wait_for(lambda: agent.counts(R) == (2, 2))
    assert plugin.register(R)["ok"]
    time.sleep(0.3)
    assert agent.counts(R) == (2, 2) and agent.resource(R)["plugin"]["connected"]
    calls = plugin.send(cmd="calls")["calls"]
    assert calls["GetDevicePluginOptions"] == 2 and calls["ListAndWatch"] == 2
    plugin.devices([["Dev1", "Unhealthy"], ["Dev2", "Healthy"]])
    wait_for(lambda: agent.counts(R) == (2, 1), what="updates flow on the new connection")


def test_hung_plugin_times_out_without_blocking_others(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    agent = agent_factory("--plugin-dial-timeout", "2s")
    hung = plugin_factory(agent.plugin_dir, "hung.sock", TWO, "--hang-options")
    # A socket that accepts connections and never speaks.
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(str(agent.plugin_dir / "mute.sock"))
    mute.listen(16)
    results: dict[str, dict[str, object]] = {}
    hung_thread = threading.Thread(target=lambda: results.update(hung=hung.register("example.com/hung")))
    started = time.monotonic()
    hung_thread.start()
    mute_plugin = plugin_factory(agent.plugin_dir, "helper.sock")
    mute_thread = threading.Thread(
        target=lambda: results.update(mute=mute_plugin.register("example.com/mute", endpoint="mute.sock"))
    )
    mute_thread.start()
    time.sleep(0.2)
    good = plugin_factory(agent.plugin_dir, "good.sock", TWO)
    t0 = time.monotonic()
    assert good.register(R)["ok"]
    assert time.monotonic() - t0 < 1.5, "a hung plugin must not block other registrations"
    hung_thread.join(10)
    mute_thread.join(10)
    mute.close()
    assert time.monotonic() - started < 5
    assert results["hung"]["ok"] is False and "failed to get device plugin options" in str(results["hung"]["error"])
    assert results["mute"]["ok"] is False and "failed to dial device plugin" in str(results["mute"]["error"])
    assert set(agent.resources()) == {R}


def test_devices_api_query(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> None:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["a", "Healthy"], ["b", "Healthy"], ["c", "Unhealthy"]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (3, 2))
    limited = agent.get(f"/api/v1/devices?resource={R}&limit=1")["resources"]
    assert [r["name"] for r in limited] == [R]
    # a cut list shows the unhealthy devices first
    assert [d["id"] for d in limited[0]["devices"]] == ["c"] and limited[0]["devicesTruncated"] is True
    assert limited[0]["capacity"] == 3, "counts stay exact when the list is truncated"
    assert agent.get("/api/v1/devices?resource=example.com/none")["resources"] == []
    for bad in ("abc", "-1"):
        with pytest.raises(urllib.error.HTTPError) as info:
            agent.get(f"/api/v1/devices?limit={bad}")
        assert info.value.code == 400
    assert agent.get_text("/healthz") == "ok"
