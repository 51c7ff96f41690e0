"""The agent's metrics: names and semantics, read at scrape time, and `promtool check metrics` clean."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

from tests.support.procs import AgentProcess, TestPlugin, wait_for
from tests.support.required import unavailable

R = "example.com/gpu"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool missing: run `make promtool`")
    return path


def test_device_metrics_follow_state(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> None:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy"], ["g1", "Healthy"], ["g2", "Unhealthy"]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (3, 2))
    assert agent.metric("deviceplane_device_plugin_registration_total", resource_name=R) == 1.0
    assert agent.metric("deviceplane_device_health", node="test-node", resource_name=R, device_id="g0") == 1.0
    assert agent.metric("deviceplane_device_health", resource_name=R, device_id="g2") == 0.0
    assert agent.metric("deviceplane_devices", resource_name=R, state="healthy") == 2.0
    assert agent.metric("deviceplane_devices", resource_name=R, state="unhealthy") == 1.0
    assert agent.metric("deviceplane_devices", resource_name=R, state="allocated") == 0.0
    assert agent.metric("deviceplane_plugin_connected", resource_name=R) == 1.0
    version = agent.get("/api/v1/devices")["agent"]["version"]
    assert agent.metric("deviceplane_agent_info", node="test-node", version=version) == 1.0

    # A device that disappears takes its series with it (no stale gauge).
    plugin.devices([["g0", "Unhealthy"], ["g1", "Healthy"]])
    wait_for(lambda: agent.counts(R) == (2, 1))
    assert agent.metric("deviceplane_device_health", resource_name=R, device_id="g2") is None
    assert agent.metric("deviceplane_device_health", resource_name=R, device_id="g0") == 0.0
    assert agent.metric("deviceplane_device_health_transitions_total", resource_name=R, device_id="g0") == 1.0

    # Its transitions too, once it is gone: a plugin naming ever new devices must not grow the agent's series.
    plugin.devices([["g1", "Healthy"]])
    wait_for(lambda: agent.counts(R) == (1, 1))
    assert agent.metric("deviceplane_device_health_transitions_total", resource_name=R, device_id="g0") is None
    assert agent.metric("deviceplane_device_health_transitions_created", resource_name=R, device_id="g0") is None


def test_promtool_check_metrics(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> None:
    tool = promtool()
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy"]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (1, 1))
    exposition = agent.get_text("/metrics")
    assert "deviceplane_device_plugin_registration_total" in exposition
    result = subprocess.run([tool, "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_heap_settled_at_start_and_collections_timed(agent_factory: Callable[..., AgentProcess]) -> None:
    """The default: what start built is collected once and frozen (agent/heap.py); CPython's own collections are
    timed by generation from then on."""
    agent = agent_factory()
    assert agent.metric("deviceplane_agent_heap_settle_seconds_count", kind="full") == 1.0
    assert agent.metric("deviceplane_agent_heap_settle_seconds_count", kind="recent") == 0.0
    assert (agent.metric("deviceplane_agent_gc_frozen_objects") or 0) > 10_000
    for generation in ("0", "1", "2"):
        assert agent.metric("deviceplane_agent_gc_pause_seconds_count", generation=generation) is not None


def test_heap_settles_off(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--gc-settle-interval", "0")
    assert agent.metric("deviceplane_agent_heap_settle_seconds_count", kind="full") == 0.0
    assert agent.metric("deviceplane_agent_gc_frozen_objects") == 0.0
    assert agent.metric("deviceplane_agent_gc_pause_seconds_count", generation="0") is not None
