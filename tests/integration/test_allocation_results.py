"""`deviceplane_allocations_total{resource_name, result}`: every result label of the README's table, each produced
by a real cause (real agent, sim and test plugins, static pod files), counted once, under the resource it concerns.
`internal` (a bug in the agent) cannot be caused by a real part: it gets an in-process test with a lookup that
raises, which says so."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deviceplane.agent.admission.admitter import AdmissionParts, AdmissionSettings, Admitter
from deviceplane.agent.admission.plugin_calls import PluginCalls
from deviceplane.agent.plugins.contracts import PluginRpc
from deviceplane.agent.plugins.startup_wait import StartupPluginWait
from deviceplane.agent.serving.metrics import AgentMetrics
from deviceplane.agent.state.checkpoint_writer import CheckpointWriter
from deviceplane.agent.state.durability import AllocationStore, CheckpointContent
from deviceplane.agent.state.journal import Journal
from deviceplane.core.allocator import AllocationResult, Allocator
from deviceplane.core.checkpoint import CheckpointEncoder
from deviceplane.core.pod_devices import PodDevices
from deviceplane.core.pod_table import PodState, PodTable
from deviceplane.core.pods import Container, Pod
from deviceplane.core.registry import Device, DeviceRegistry, PluginOptions
from tests.support.alloc_env import alloc_env
from tests.support.pods import container, pod_manifest, simple_pod, wait_settled, write_pod
from tests.support.procs import AgentProcess, TestPlugin, wait_for

A = "example.com/a"  # sim, 2 devices, no topology: success and the RPC failures
B = "example.com/b"  # sim, its only device unhealthy
C = "example.com/c"  # sim that goes away during an admission
T = "example.com/t"  # sim, 4 devices on 2 NUMA nodes: a 3-device request fails the single-numa-node policy
E = "example.com/empty"  # test plugin answering Allocate with no container response
NONE = "example.com/none"  # nobody serves it
UNREGISTERED = "<unregistered>"  # what its failures are counted under


def count(agent: AgentProcess, resource: str, result: str) -> float:
    return agent.metric("deviceplane_allocations_total", resource_name=resource, result=result) or 0.0


def failed(agent: AgentProcess, name: str) -> str:
    pod = wait_settled(agent, name)
    assert not pod["admitted"], pod
    return str(pod["reason"])


def test_each_result_is_counted_once_under_its_resource(short_tmp: Path) -> None:
    with alloc_env(short_tmp, "--topology-policy", "single-numa-node", "--numa-nodes", "2") as env:
        agent = env.start_agent("--allocate-timeout", "1s")
        a = env.sim(A, 2)
        b = env.sim(B, 1)
        c = env.sim(C, 1)
        env.sim(T, 4, 2)
        empty = TestPlugin(env.plugin_dir, "empty.sock", [["e-0", "Healthy"]], "--alloc-response", "{}")
        try:
            assert empty.register(E)["ok"]
            env.wait_devices(E, 1)

            simple_pod(env.pod_dir, "ok", A, 1)
            assert wait_settled(agent, "ok")["admitted"]
            assert count(agent, A, "success") == 1

            assert count(agent, UNREGISTERED, "unregistered") == 0  # exists from the start, so increase() sees it
            simple_pod(env.pod_dir, "unregistered", NONE, 1)
            assert failed(agent, "unregistered") == f"cannot allocate unregistered device {NONE}"
            # A pod may name any resource: counted under one label, not a series per name.
            assert count(agent, UNREGISTERED, "unregistered") == 1
            assert 'resource_name="example.com/none"' not in agent.get_text("/metrics")

            b.control("POST", "/devices/sim-0/unhealthy")
            env.wait_devices(B, 0)
            simple_pod(env.pod_dir, "unhealthy", B, 1)
            assert failed(agent, "unhealthy").startswith("no healthy devices present")
            assert count(agent, B, "unhealthy") == 1

            simple_pod(env.pod_dir, "unavailable", A, 2)  # one of the two is held by "ok"
            assert failed(agent, "unavailable").startswith(f"requested number of devices unavailable for {A}")
            assert count(agent, A, "unavailable") == 1

            simple_pod(env.pod_dir, "topology", T, 3)
            assert "single-numa-node" in failed(agent, "topology")
            assert count(agent, T, "topology") == 1

            simple_pod(env.pod_dir, "empty", E, 1)
            assert failed(agent, "empty").startswith("no containers return in allocation response")
            assert count(agent, E, "empty_response") == 1

            for rpc, name, result, reason in [
                ("Allocate", "rpc-error", "rpc_error", "rpc error: code = Unknown"),
                ("GetPreferredAllocation", "preferred", "preferred_rpc_error", "device plugin GetPreferredAllocation"),
                ("PreStartContainer", "pre-start", "pre_start_error", "device plugin PreStartContainer"),
            ]:
                a.control("PUT", f"/faults/{rpc}", {"mode": "fail", "times": 1})
                simple_pod(env.pod_dir, name, A, 1)
                assert failed(agent, name).startswith(reason)
                assert count(agent, A, result) == 1

            a.control("PUT", "/faults/Allocate", {"mode": "hang", "times": 1})
            simple_pod(env.pod_dir, "timeout", A, 1)
            assert failed(agent, "timeout").startswith("rpc error: code = DeadlineExceeded")
            assert count(agent, A, "timeout") == 1

            # C's plugin leaves while A's PreStartContainer (called first) hangs: C's is then due with no plugin.
            a.control("PUT", "/faults/PreStartContainer", {"mode": "hang", "seconds": 3, "times": 1})
            a.control("DELETE", "/calls")
            write_pod(env.pod_dir, "gone.json", pod_manifest("gone", [container("main", {A: 1, C: 1})]))
            wait_for(lambda: a.control("GET", "/calls")["counts"]["PreStartContainer"], what="PreStart to hang")
            c.stop()
            assert failed(agent, "gone") == f"endpoint not found in cache for a registered resource: {C}"
            assert count(agent, C, "no_endpoint") == 1

            # Each failed admission counted once; success once per allocated container resource ("ok", and the
            # Allocates of "pre-start" and "gone" that succeeded before their admission failed); nothing else.
            series = {
                line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in agent.get_text("/metrics").splitlines()
                if line.startswith("deviceplane_allocations_total{")
            }
            expected = [(A, "success", 3), (C, "success", 1), (UNREGISTERED, "unregistered", 1), (B, "unhealthy", 1),
                        (A, "unavailable", 1), (T, "topology", 1), (E, "empty_response", 1), (A, "rpc_error", 1),
                        (A, "preferred_rpc_error", 1), (A, "pre_start_error", 1), (A, "timeout", 1),
                        (C, "no_endpoint", 1)]  # fmt: skip
            assert {name: n for name, n in series.items() if n} == {
                f'deviceplane_allocations_total{{resource_name="{r}",result="{k}"}}': n for r, k, n in expected
            }
            # Every result of a registered resource is there from its registration, at 0 until counted.
            for resource in (A, B, C, E, T):
                for result in AllocationResult:  # `internal` too: PreStart's "no devices found" names one
                    assert f'deviceplane_allocations_total{{resource_name="{resource}",result="{result}"}}' in series
            assert {k for _r, k, _n in expected} == {r.value for r in AllocationResult} - {
                "changed_request",
                "internal",
            }
        finally:
            empty.stop()


def test_changed_request(short_tmp: Path) -> None:
    with alloc_env(short_tmp) as env:
        agent = env.start_agent()
        env.sim(A, 2)
        write_pod(env.pod_dir, "p.json", pod_manifest("p", [container("main", {A: 1})], uid="uid-p"))
        assert wait_settled(agent, "p")["admitted"]
        agent.stop()
        write_pod(env.pod_dir, "p.json", pod_manifest("p", [container("main", {A: 2})], uid="uid-p"))
        agent = env.start_agent()
        assert failed(agent, "p") == f'pod "uid-p" container "main" changed request for resource "{A}" from 1 to 2'
        assert count(agent, A, "changed_request") == 1


class BrokenLookup:
    """A fake: no real part makes the agent's own code raise. Looking up a plugin raises, as a bug would."""

    def client(self, resource: str) -> PluginRpc | None:
        raise RuntimeError("lookup bug")


async def test_internal_error_is_counted_without_resource(tmp_path: Path) -> None:
    registry = DeviceRegistry(300)
    registry.plugin_connected(A, "/a.sock", PluginOptions(), 0)
    registry.apply_snapshot(A, "/a.sock", [Device("a-0", "Healthy")])
    pod_devices = PodDevices()
    content = CheckpointContent(registry, pod_devices)
    checkpoint = CheckpointWriter(lambda _blob: None, content.snapshot, CheckpointEncoder())
    store = AllocationStore(pod_devices, Journal(tmp_path), content, checkpoint)
    store.restore(None)
    metrics = AgentMetrics(registry, "node", pod_devices.allocated_count)
    table = PodTable()
    parts = AdmissionParts(
        table, pod_devices, Allocator(registry, pod_devices), store,
        PluginCalls(BrokenLookup(), metrics), StartupPluginWait(registry), metrics,
    )  # fmt: skip
    admitter = Admitter(parts, AdmissionSettings())
    record = table.add(Pod("u", "default", "p", "Pending", (), (Container("c", ((A, 1),)),)), "test", "p")
    await admitter.admit(record)
    assert record.state == PodState.FAILED and record.reason == "internal error: lookup bug"
    sample = metrics.prometheus.get_sample_value(
        "deviceplane_allocations_total", {"resource_name": "", "result": AllocationResult.INTERNAL.value}
    )
    assert sample == 1
    assert pod_devices.pods() == set()
    await asyncio.wait_for(store.close(), 10)
