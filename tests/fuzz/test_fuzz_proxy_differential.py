"""Proxy mode, differentially: a real plugin process sends fuzzed ListAndWatch snapshots (IDs from a small alphabet,
so they repeat; health strings around "Healthy"; NUMA IDs around 64, or no topology) through a proxy-mode agent to
the kubelet's real device manager (our Go harness). After each, once both sides have applied it, the agent's
counts are the kubelet's, it lists each device the kubelet lists as allocatable with the same health string and NUMA
nodes (every other one Unhealthy), and the agent stays live. (The same for hand-picked snapshots, with
the values recorded: tests/e2e/test_proxy_snapshots.py.)"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.e2e.cluster import built_binary
from tests.e2e.harness import Harness, start_harness
from tests.e2e.procs import Procs
from tests.fuzz.conftest import assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, TestPlugin, wait_for
from tests.support.proxy_sides import AgentSide, Side, agent_side, differences, kubelet_side, push_and_read

RESOURCE = "example.com/px"
Sent = tuple[str, str, list[int]]  # id, health, NUMA nodes
DEVICE = st.tuples(
    st.one_of(st.sampled_from(["a", "b", "c", "d"]), st.text(max_size=2)),
    st.one_of(st.sampled_from(["Healthy", "Unhealthy", "healthy", "", "Healthy ", "HEALTHY"]), st.text(max_size=3)),
    st.lists(st.integers(-1, 70), max_size=2),  # [] is no topology
)


@dataclass
class Proxied:
    harness: Harness
    agent: AgentProcess
    plugin: TestPlugin
    markers: Iterator[int]

    def read(self) -> tuple[Side | None, AgentSide | None]:
        return kubelet_side(self.harness.capacity(), RESOURCE), agent_side(self.agent.resource(RESOURCE))


@pytest.fixture(scope="module")
def proxied(fuzz_root: Path) -> Iterator[Proxied]:
    """The harness, a proxy-mode agent in front of it, and one plugin behind the agent, for every example."""
    exe = built_binary("kubelet-harness")
    procs = Procs(fuzz_root / "px-logs")
    kubelet_dir, pod_resources = fuzz_root / "kdp", fuzz_root / "kpr" / "kubelet.sock"
    kubelet_dir.mkdir()
    pod_resources.parent.mkdir()
    agent = None
    plugin = None
    try:
        harness = start_harness(procs, exe, kubelet_dir, pod_resources_socket=pod_resources)
        agent = AgentProcess(
            fuzz_root / "px-agent",
            "--mode", "proxy",
            "--kubelet-dir", str(kubelet_dir),
            "--kubelet-pod-resources-socket", str(pod_resources),
            plugin_dir=fuzz_root / "px",
        ).start()  # fmt: skip
        plugin = TestPlugin(agent.plugin_dir, "px.sock", [])
        assert plugin.register(RESOURCE)["ok"]
        yield Proxied(harness, agent, plugin, itertools.count())
    finally:
        if plugin is not None:
            plugin.stop()
        if agent is not None:
            agent.kill()
        procs.stop_all()
        assert not procs.leftovers(), procs.leftovers()


@fuzz_settings(bounded=150, long=10_000)
@given(st.lists(DEVICE, max_size=8))
def test_fuzz_proxy_modes_view_counts_as_the_kubelet(proxied: Proxied, devices: list[Sent]) -> None:
    kubelet, agent = push_and_read(proxied.plugin, next(proxied.markers), [list(d) for d in devices], proxied.read)
    # capacity, allocatable, and each allocatable device's health string and NUMA nodes; every other one Unhealthy
    assert not differences(kubelet, agent), (devices, differences(kubelet, agent))
    assert agent.listed == {device_id for device_id, _, _ in devices}
    assert_live(proxied.agent)


def test_zz_the_plugins_stream_is_the_same_live_one(proxied: Proxied) -> None:
    """Every example went over the one stream the plugin opened (the agent never dropped and re-dialled it)."""
    calls: dict[str, Any] = proxied.plugin.send(cmd="calls")
    assert calls["calls"]["ListAndWatch"] == 1, calls
    proxied.plugin.devices([["z", "Healthy", [0]]])
    wait_for(
        lambda: proxied.read()[0] == Side(1, 1, {"z": ("Healthy", (0,))}), what="the last snapshot, on the kubelet"
    )
