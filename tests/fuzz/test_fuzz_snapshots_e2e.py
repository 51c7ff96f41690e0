"""One end-to-end property for ListAndWatch: a real plugin process sends fuzzed snapshots over real gRPC to a real
agent, and the agent's /api/v1/devices shows exactly what core.snapshot makes of each (last repeated id counts;
Healthy only for "Healthy" with representable NUMA ids), with consistent counts, and the agent stays live."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.topology import MAX_NUMA_NODES
from tests.fuzz.conftest import DEVICES, RESOURCE, assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, TestPlugin, wait_for

INT64 = st.integers(-(2**63), 2**63 - 1)
DEVICE = st.tuples(
    st.one_of(st.sampled_from(["d0", "d1", "d2", "x"]), st.text(min_size=1, max_size=6)),
    st.one_of(st.sampled_from(["Healthy", "Unhealthy", "healthy", ""]), st.text(max_size=4)),
    st.lists(st.one_of(st.integers(-1, 2), st.integers(62, 66), INT64), max_size=2),
)


def expected(devices: list[tuple[str, str, list[int]]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    last = {device_id: (health, tuple(nodes)) for device_id, health, nodes in devices}
    return {
        device_id: ("Healthy" if health == "Healthy" and all(n < MAX_NUMA_NODES for n in nodes) else "Unhealthy", nodes)
        for device_id, (health, nodes) in last.items()
    }


@fuzz_settings(bounded=100, long=10_000)
@given(st.lists(DEVICE, max_size=6))
def test_fuzz_snapshots_through_grpc(
    fuzz_agent: AgentProcess, fuzz_plugin: TestPlugin, devices: list[tuple[str, str, list[int]]]
) -> None:
    want = expected(devices)
    fuzz_plugin.devices([list(d) for d in devices])

    def shown() -> dict[str, Any] | None:
        resource = fuzz_agent.resource(RESOURCE)
        if resource is None or not resource["plugin"]["connected"]:
            return None
        view = {d["id"]: (d["health"], tuple(d["numaNodes"])) for d in resource["devices"]}
        return resource if view == want else None

    resource = wait_for(shown, timeout=20, what=f"the agent to show {want}")
    healthy = sum(1 for health, _ in want.values() if health == "Healthy")
    assert (resource["capacity"], resource["allocatable"], resource["healthy"]) == (len(want), healthy, healthy)
    assert resource["unhealthy"] == len(want) - healthy
    assert_live(fuzz_agent)


def test_zz_restore_devices(fuzz_agent: AgentProcess, fuzz_plugin: TestPlugin) -> None:
    """Leave the module's plugin as it started (and prove the stream is still the same, live one)."""
    fuzz_plugin.devices(DEVICES)
    wait_for(lambda: fuzz_agent.counts(RESOURCE) == (4, 4), what="the original devices")
