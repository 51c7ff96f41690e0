"""Finding 2 of issue 9: a NUMA node id no bitmask can hold (upstream's is 64 bits) is refused at the ListAndWatch
boundary: that device reads Unhealthy with a log line saying why, the resource's other devices stay usable."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.pods import simple_pod, wait_settled
from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/numa"


@pytest.mark.parametrize("node", [2**31, 2**62])
def test_huge_numa_id_leaves_the_resource_usable(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin], short_tmp: Path, node: int
) -> None:
    pods = short_tmp / "pods"
    agent = agent_factory(
        "--topology-policy", "single-numa-node", "--numa-nodes", "2",
        "--pod-manifest-dir", str(pods), "--startup-plugin-wait", "0s",
    )  # fmt: skip
    devices = [["a", "Healthy", [0]], ["b", "Healthy", [1]], ["x1", "Healthy", [node]], ["x2", "Healthy", [0, node]]]
    plugin = plugin_factory(agent.plugin_dir, "numa.sock", devices)
    assert plugin.register(R)["ok"]
    seen = wait_for(lambda: agent.devices(R) if agent.devices(R) and len(agent.devices(R)) == 4 else None)
    assert seen == {
        "a": ("Healthy", (0,)),
        "b": ("Healthy", (1,)),
        "x1": ("Unhealthy", (node,)),
        "x2": ("Unhealthy", (0, node)),
    }
    assert agent.counts(R) == (4, 2)
    started = time.monotonic()
    for i in range(2):
        simple_pod(pods, f"p{i}", R)
    admitted = [wait_settled(agent, f"p{i}") for i in range(2)]
    assert [p["state"] for p in admitted] == ["admitted", "admitted"], admitted
    assert time.monotonic() - started < 10  # not seconds of a blocked loop per device (it was 5.8 s for three)
    log = agent.log()
    assert f"NUMA node id {node} is out of range (ids must be below 64)" in log
    assert log.count('"device": "x1"') == 1  # once, not on every snapshot
    plugin.devices(devices)
    wait_for(lambda: agent.healthy())
    assert agent.log().count('"device": "x1"') == 1


def test_more_numa_nodes_than_the_kubelet_allows_are_refused_at_start(short_tmp: Path) -> None:
    """Upstream's topology manager refuses more than 8 NUMA nodes for any policy but none (its hint merge is
    exponential in the node count); so does the agent, before serving anything, with the kubelet's words."""
    from tests.integration.test_agent_cluster_mode import run_agent

    result = run_agent(short_tmp, "--standalone", "--topology-policy", "restricted", "--numa-nodes", "9")
    assert result.returncode == 1, result.stderr
    expected = "--topology-policy restricted with 9 NUMA nodes: unsupported on machines with more than 8 NUMA Nodes"
    assert expected in result.stderr, result.stderr
    assert not (short_tmp / "dp" / "kubelet.sock").exists()  # nothing was served


@pytest.mark.parametrize("flags", [("restricted", "8"), ("none", "64")])
def test_numa_node_counts_the_kubelet_accepts_start(short_tmp: Path, flags: tuple[str, str]) -> None:
    policy, count = flags
    agent = AgentProcess(short_tmp, "--topology-policy", policy, "--numa-nodes", count)
    try:
        agent.start()
        assert agent.healthy()
    finally:
        agent.stop()
