"""Proxy mode with snapshots a plugin may not send (a device ID twice, a NUMA node ID >= 64, odd health strings, no
devices): the kubelet's real device manager (our Go harness) gets them as sent and counts them by its own rules, and
the agent's view must count them as the kubelet does - the kubelet publishes the Node's capacity and allocates. The
fuzzed version of this is tests/fuzz/test_fuzz_proxy_differential.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.procs import TestPlugin
from tests.support.proxy_sides import AgentSide, Listed, Side, agent_side, differences, kubelet_side, push_and_read

from .conftest import Agent
from .harness import Harness
from .test_proxy import kubelet_side as kubelet_dirs
from .test_proxy import start_proxy

RESOURCE = "example.com/odd"

# (what, snapshot, the kubelet's (capacity, allocatable) by spec §4.4-4.5: every message rebuilds a healthy and an
# unhealthy ID set, "Healthy" exactly goes to the first, anything else to the second; capacity is the sum of their
# sizes, allocatable the healthy one's)
CASES: list[tuple[str, Listed, tuple[int, int]]] = [
    ("an ID twice, both Healthy", [["a", "Healthy", []], ["a", "Healthy", []], ["b", "Healthy", []]], (2, 2)),
    (
        "an ID twice, Healthy then Unhealthy",
        [["a", "Healthy", []], ["a", "Unhealthy", [1]], ["b", "Healthy", []]],
        (3, 2),
    ),
    ("an ID twice, Unhealthy then Healthy", [["a", "Unhealthy", []], ["a", "Healthy", [0]]], (2, 1)),
    ("an ID twice, Healthy then empty", [["a", "Healthy", [0]], ["a", "", []], ["b", "Unhealthy", []]], (3, 1)),
    (
        "an ID three times, the last healthy",
        [["a", "Healthy", []], ["a", "Unhealthy", []], ["a", "healthy", [2]]],
        (2, 1),
    ),
    ("an ID twice, both not exactly Healthy", [["a", "healthy", []], ["a", "", []]], (1, 0)),
    (
        "NUMA IDs 64 and 70",
        [["a", "Healthy", [64]], ["b", "Healthy", [0]], ["c", "Healthy", [70, 1]], ["d", "Healthy", [63]]],
        (4, 4),
    ),
    ("an ID twice, NUMA 64 then 0", [["a", "Healthy", [64]], ["a", "Healthy", [0]]], (1, 1)),
    ("an ID twice, NUMA 0 then 64", [["a", "Healthy", [0]], ["a", "Healthy", [64]]], (1, 1)),
    (
        "health strings other than Healthy",
        [["a", "healthy", []], ["b", "", []], ["c", "Unhealthy", []], ["d", "HEALTHY", []], ["e", "Healthy ", []],
         ["f", "Healthy", []]],
        (6, 1),
    ),
    ("no devices", [], (0, 0)),
]  # fmt: skip


def test_the_agents_proxy_view_counts_bad_snapshots_as_the_kubelet_does(
    kubelet_harness: Callable[..., Harness],
    deviceplane_agent: Callable[..., Agent],
    test_plugins: Callable[..., TestPlugin],
    short_tmp: Callable[[str], Path],
) -> None:
    kubelet_dir, pod_resources = kubelet_dirs(short_tmp)
    harness = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    plugin = test_plugins(agent.plugin_dir, "odd.sock", [])
    assert plugin.register(RESOURCE)["ok"]

    def read() -> tuple[Side | None, AgentSide | None]:
        return kubelet_side(harness.capacity(), RESOURCE), agent_side(agent.resource(RESOURCE))

    rows, wrong = [], []
    for n, (what, devices, by_spec) in enumerate(CASES):
        kubelet, shown = push_and_read(plugin, n, devices, read)
        rows.append(
            f"{what}: kubelet {kubelet.capacity}/{kubelet.allocatable} allocatable {sorted(kubelet.devices.items())}; "
            f"agent {shown.capacity}/{shown.allocatable} lists {sorted(shown.devices.items())}"
        )
        if (kubelet.capacity, kubelet.allocatable) != by_spec:
            wrong.append(f"{what}: the kubelet counted {kubelet.capacity}/{kubelet.allocatable}, the spec {by_spec}")
        wrong += [f"{what}: the agent's {difference}" for difference in differences(kubelet, shown)]
    assert not wrong, "\n".join([*wrong, "", *rows])
    # What the kubelet lists of an ID sent Healthy and then otherwise: allocatable, with the last copy's health.
    assert rows[1].split("; ")[0].endswith("allocatable [('a', ('Unhealthy', (1,))), ('b', ('Healthy', ()))]"), rows
    assert agent.proc.alive()

    # The problems are still logged, once per device and problem, saying that nothing was corrected.
    records = log_records(agent)
    logged = {
        (r["device"], r["reason"].split(";")[0])
        for r in records
        if r["msg"].startswith("device snapshot taken as sent")
    }
    assert logged >= {
        ("a", "device id sent more than once"),
        ("a", "NUMA node id 64 is out of range (ids must be below 64)"),
        ("c", "NUMA node id 70 is out of range (ids must be below 64)"),
    }, logged
    assert not any(r["msg"].startswith("device snapshot corrected") for r in records)


def log_records(agent: Agent) -> list[dict[str, Any]]:
    lines = agent.proc.log.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]
