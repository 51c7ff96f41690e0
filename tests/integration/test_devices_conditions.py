"""/api/v1/devices reports the conditions NodeDevices has (the same view, DESIGN): a real agent and a real sim plugin,
killed and started again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.plugins import PluginProcess
from tests.support.procs import AgentProcess, wait_for

SIM = "example.com/sim"


@pytest.fixture
def sims(short_tmp: Path) -> Iterator[Callable[[Path], PluginProcess]]:
    started: list[PluginProcess] = []

    def start(plugin_dir: Path) -> PluginProcess:
        plugin = PluginProcess(short_tmp / "sim", "sim", "--plugin-dir", str(plugin_dir), "--count", "2")
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.kill()


def conditions(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in agent.get("/api/v1/devices")["conditions"]}


def states(agent: AgentProcess) -> dict[str, str]:
    return {kind: c["status"] for kind, c in conditions(agent).items()}


def test_plugins_connected_follows_the_plugin(agent: AgentProcess, sims: Callable[[Path], PluginProcess]) -> None:
    sim = sims(agent.plugin_dir)
    up = {"PluginsConnected": "True", "DevicesHealthy": "True"}
    wait_for(lambda: (agent.counts(SIM), states(agent)) == ((2, 2), up), timeout=15, what="sim's devices, all True")
    first = conditions(agent)
    assert first["PluginsConnected"]["message"] == "1 of 1 plugins connected"
    time.sleep(1.1)  # a later second: a time recomputed at each request would differ
    assert conditions(agent) == first  # transition times kept across requests

    sim.kill()
    down = {"PluginsConnected": "False", "DevicesHealthy": "False"}  # its devices are unhealthy meanwhile
    wait_for(lambda: states(agent) == down, timeout=10, what="PluginsConnected False")
    gone = conditions(agent)["PluginsConnected"]
    assert (gone["reason"], gone["message"]) == ("PluginDisconnected", f"not connected: {SIM}")
    assert gone["lastTransitionTime"] > first["PluginsConnected"]["lastTransitionTime"]
    # /api/v1/devices?resource= lists one resource, the conditions still are the node's
    assert {c["type"]: c for c in agent.get(f"/api/v1/devices?resource={SIM}&limit=0")["conditions"]} == (
        conditions(agent)
    )

    time.sleep(1.1)
    sims(agent.plugin_dir)
    wait_for(lambda: states(agent) == up, timeout=15, what="PluginsConnected True again")
    back = conditions(agent)["PluginsConnected"]
    assert (back["reason"], back["message"]) == ("AllConnected", "1 of 1 plugins connected")
    assert back["lastTransitionTime"] > gone["lastTransitionTime"]
