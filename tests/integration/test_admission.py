"""Admission over real sockets and processes: static pod files in, the sim plugin's recorded RPCs and the agent's
views out. Mirrors spec §6.1 items 9, 11-18, 20, 21 as they apply without a kubelet, and §4.12's examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplane.core.checkpoint import decode
from tests.support.alloc_env import AllocEnv, alloc_env
from tests.support.pods import (
    container,
    devices_of,
    pod_manifest,
    pods,
    simple_pod,
    wait_settled,
    write_pod,
)
from tests.support.procs import wait_for

R1 = "domain1.com/resource1"
R2 = "domain2.com/resource2"


def calls(plugin: Any, rpc: str) -> list[dict[str, Any]]:
    return list(plugin.control("GET", "/calls")[rpc])


def allocated(env: AllocEnv, resource: str) -> int:
    assert env.agent is not None
    r = env.agent.resource(resource)
    return -1 if r is None else int(r["allocated"])


def test_pod_container_device_allocation(env: AllocEnv) -> None:
    """§6.1 item 11: A takes res1:2 + res2:1; B (res1:1) fails with upstream's message; C gets the last res2."""
    s1 = env.sim(R1, 2, 2)
    s2 = env.sim(R2, 2, 0)
    write_pod(env.pod_dir, "a.yaml", pod_manifest("a", [container("c", {R1: 2, R2: 1, "cpu": 2})]))
    a = wait_settled(env.agent, "a")
    assert a["admitted"], a
    assert devices_of(a, R1) == {"sim-0", "sim-1"} and len(devices_of(a, R2)) == 1
    options = a["containers"][0]["runOptions"]
    # both sims call their devices sim-N: /dev/sim-0 and SIM_DEVICES conflict, and the first resource wins (§4.10)
    assert len(options["devices"]) == 2 and options["envs"] == {"SIM_DEVICES": "sim-0,sim-1"}
    # ... and the conflicts are logged (upstream only logs them), once for the container
    entries = [json.loads(line) for line in env.agent.log().splitlines() if line.startswith("{")]
    logged = [e for e in entries if e.get("msg") == "conflicting run options"]
    assert [(e["pod"], e["container"]) for e in logged] == [("default/a", "c")]
    assert any("Environment variable SIM_DEVICES has conflicting setting" in c for c in logged[0]["conflicts"])
    assert [c["devices_ids"] for c in calls(s1, "Allocate")] == [["sim-0", "sim-1"]]
    assert len(calls(s2, "Allocate")) == 1

    simple_pod(env.pod_dir, "b", R1, 1)
    b = wait_settled(env.agent, "b")
    assert not b["admitted"]
    assert b["reason"] == f"requested number of devices unavailable for {R1}. Requested: 1, Available: 0"
    assert b["containers"][0]["devices"] == {} and b["containers"][0]["runOptions"] is None
    assert len(calls(s1, "Allocate")) == 1  # no RPC for a pod that cannot fit

    simple_pod(env.pod_dir, "c", R2, 1)
    c = wait_settled(env.agent, "c")
    assert c["admitted"] and not devices_of(c, R2) & devices_of(a, R2)
    assert allocated(env, R1) == 2 and allocated(env, R2) == 2
    assert env.agent.metric("deviceplane_allocations_total", resource_name=R1, result="success") == 1
    assert env.agent.metric("deviceplane_device_plugin_alloc_duration_seconds_count", resource_name=R1) == 1


def test_devices_to_allocate_errors(env: AllocEnv) -> None:
    """§6.1 item 12 through the agent: unregistered resource, and no healthy devices left."""
    simple_pod(env.pod_dir, "unknown", R2, 1)
    assert wait_settled(env.agent, "unknown")["reason"] == f"cannot allocate unregistered device {R2}"
    sim = env.sim(R1, 2)
    sim.control("POST", "/health", {"sim-0": False, "sim-1": False})
    env.wait_devices(R1, 0)
    simple_pod(env.pod_dir, "sick", R1, 1)
    reason = wait_settled(env.agent, "sick")["reason"]
    assert reason == f"no healthy devices present; cannot allocate unhealthy devices {R1}"


def test_failed_admission_releases_what_it_took(env: AllocEnv) -> None:
    """A pod whose second resource fails in Allocate keeps nothing of the first; the error is the plugin's."""
    env.sim(R1, 2)
    s2 = env.sim(R2, 2)
    s2.control("PUT", "/faults/Allocate", {"mode": "fail", "message": "out of sim juice"})
    write_pod(env.pod_dir, "p.json", pod_manifest("p", [container("one", {R1: 2}), container("two", {R2: 1})]))
    p = wait_settled(env.agent, "p")
    assert not p["admitted"]
    assert p["reason"].startswith("rpc error: code = Unknown desc = ") and "out of sim juice" in p["reason"]
    assert allocated(env, R1) == 0 and allocated(env, R2) == 0
    assert env.agent.metric("deviceplane_allocations_total", resource_name=R2, result="rpc_error") == 1
    simple_pod(env.pod_dir, "q", R1, 2)
    assert wait_settled(env.agent, "q")["admitted"]  # the released devices can be given again


def test_hanging_allocate_fails_only_its_own_admissions(short_tmp: Path) -> None:
    with alloc_env(short_tmp, "--allocate-timeout", "5s") as env:
        env.start_agent()
        stuck = env.sim(R1, 4)
        env.sim(R2, 4)
        stuck.control("PUT", "/faults/Allocate", {"mode": "hang"})
        simple_pod(env.pod_dir, "hung", R1, 1)
        wait_for(lambda: calls(stuck, "Allocate"), what="the hanging Allocate to start")
        for i in range(3):
            simple_pod(env.pod_dir, f"ok{i}", R2, 1)
        for i in range(3):
            assert wait_settled(env.agent, f"ok{i}")["admitted"]
        # the others finished while the hung admission is still waiting on its plugin
        assert pods(env.agent)["hung"]["state"] == "admitting"
        hung = wait_settled(env.agent, "hung")
        assert not hung["admitted"]
        assert hung["reason"].startswith("rpc error: code = DeadlineExceeded")
        assert allocated(env, R1) == 0
        stuck.control("DELETE", "/faults/Allocate")
        simple_pod(env.pod_dir, "after", R1, 1)
        assert wait_settled(env.agent, "after")["admitted"]


def test_removal_and_terminal_phase_release(env: AllocEnv) -> None:
    """§6.1 item 14: a pod gone (file removed) or finished (phase Succeeded) frees its devices."""
    env.sim(R1, 3)
    path = simple_pod(env.pod_dir, "gone", R1, 1)
    simple_pod(env.pod_dir, "done", R1, 1, uid="done-uid")
    assert wait_settled(env.agent, "gone")["admitted"] and wait_settled(env.agent, "done")["admitted"]
    assert allocated(env, R1) == 2
    path.unlink()
    wait_for(lambda: "gone" not in pods(env.agent) and allocated(env, R1) == 1, what="removed pod released")
    simple_pod(env.pod_dir, "done", R1, 1, uid="done-uid", phase="Succeeded")
    done = wait_for(lambda: pods(env.agent)["done"]["state"] == "terminated" and pods(env.agent)["done"],
                    what="terminated")  # fmt: skip
    assert done["reason"] == "pod phase Succeeded" and not done["admitted"]
    wait_for(lambda: allocated(env, R1) == 0, what="finished pod released")


def test_malformed_files_are_reported_and_harm_nothing(env: AllocEnv) -> None:
    env.sim(R1, 2)
    write_pod(env.pod_dir, "broken.yaml", "kind: Pod\nmetadata: {name: x\n")
    write_pod(env.pod_dir, "frac.json", pod_manifest("frac", [container("c", {R1: 1})]) | {"spec": {"containers": [
        {"name": "c", "resources": {"limits": {R1: "0.5"}}}]}})  # fmt: skip
    write_pod(env.pod_dir, "two.yaml", "kind: Pod\n---\nkind: Pod\n")
    simple_pod(env.pod_dir, "good", R1, 1)
    assert wait_settled(env.agent, "good")["admitted"]
    view = wait_for(lambda: (v := pods(env.agent)) and len(v) == 4 and v, what="all files reported")
    assert view["file:broken.yaml"]["reason"].startswith("broken.yaml: invalid YAML")
    assert "extended resources must be whole numbers" in view["file:frac.json"]["reason"]
    assert "expected exactly one Pod per file, found 2" in view["file:two.yaml"]["reason"]
    assert all(not v["admitted"] for k, v in view.items() if k != "good")
    assert env.agent.proc is not None and env.agent.proc.poll() is None


def test_init_container_devices_are_reused(env: AllocEnv) -> None:
    """§6.1 item 15."""
    env.sim(R1, 4)
    env.sim(R2, 2)
    manifest = pod_manifest(
        "p",
        [container("app1", {R1: 1, R2: 1}), container("app2", {R1: 1, R2: 1})],
        init=[container("init1", {R1: 1}), container("init2", {R1: 2})],
    )
    write_pod(env.pod_dir, "p.json", manifest)
    p = wait_settled(env.agent, "p")
    assert p["admitted"], p
    held = {c["name"]: set(c["devices"].get(R1, [])) for c in p["containers"]}
    assert len(held["init1"]) == 1 and len(held["init2"]) == 2
    assert held["init1"] <= held["init2"] and held["app1"] <= held["init2"] and held["app2"] <= held["init2"]
    assert len(held["app1"]) == 1 and len(held["app2"]) == 1 and not held["app1"] & held["app2"]
    assert allocated(env, R1) == 2


def test_restartable_init_containers_keep_devices(env: AllocEnv) -> None:
    """§6.1 item 16."""
    env.sim(R1, 6)
    manifest = pod_manifest(
        "p",
        [container("app1", {R1: 1}), container("app2", {R1: 2})],
        init=[
            container("regular", {R1: 3}),
            container("side1", {R1: 1}, restart_policy="Always"),
            container("side2", {R1: 2}, restart_policy="Always"),
        ],
    )
    write_pod(env.pod_dir, "p.json", manifest)
    p = wait_settled(env.agent, "p")
    assert p["admitted"], p
    held = {c["name"]: set(c["devices"][R1]) for c in p["containers"]}
    assert held["side1"] | held["side2"] <= held["regular"]
    dedicated = ["side1", "side2", "app1", "app2"]
    for i, a in enumerate(dedicated):
        for b in dedicated[i + 1 :]:
            assert not held[a] & held[b], (a, b)
    assert [c["type"] for c in p["containers"]] == ["init", "sidecar", "sidecar", "app", "app"]


def test_pre_start_container_where_asked(env: AllocEnv) -> None:
    """§6.1 item 18: PreStartContainer gets both devices after Allocate; a zero request triggers nothing."""
    sim = env.sim(R1, 2)  # the sim asks for PreStartContainer
    write_pod(env.pod_dir, "p.json", pod_manifest("p", [container("c", {R1: 2}), container("z", {R1: 0})]))
    p = wait_settled(env.agent, "p")
    assert p["admitted"]
    pre = calls(sim, "PreStartContainer")
    assert [sorted(c["devices_ids"]) for c in pre] == [["sim-0", "sim-1"]]
    assert pre[0]["time"] >= calls(sim, "Allocate")[0]["time"]
    assert p["containers"][0]["runOptions"]["envs"] == {"SIM_DEVICES": "sim-0,sim-1"}


def test_pre_start_failure_fails_the_admission(env: AllocEnv) -> None:
    sim = env.sim(R1, 2)
    sim.control("PUT", "/faults/PreStartContainer", {"mode": "fail", "message": "not today"})
    simple_pod(env.pod_dir, "p", R1, 1)
    p = wait_settled(env.agent, "p")
    assert p["reason"].startswith("device plugin PreStartContainer rpc failed with err: rpc error: code = Unknown")
    assert allocated(env, R1) == 0


def test_preferred_allocation_followed_and_gc_during_it(env: AllocEnv) -> None:
    """§6.1 item 13: while GetPreferredAllocation is in flight another pod is released; all goes on."""
    sim = env.sim(R1, 4, 2)
    path = simple_pod(env.pod_dir, "other", R1, 1)
    assert wait_settled(env.agent, "other")["admitted"]
    sim.control("PUT", "/faults/GetPreferredAllocation", {"mode": "hang", "seconds": 1.0, "times": 1})
    simple_pod(env.pod_dir, "slow", R1, 2)
    wait_for(lambda: len(calls(sim, "GetPreferredAllocation")) == 2, what="preferred allocation in flight")
    path.unlink()
    wait_for(lambda: "other" not in pods(env.agent), what="other released")
    slow = wait_settled(env.agent, "slow")
    assert slow["admitted"]
    asked = calls(sim, "GetPreferredAllocation")[1]
    assert asked["allocation_size"] == 2 and asked["must_include_deviceIDs"] == []
    assert devices_of(slow, R1) == set(asked["result"])


def test_allocated_resources_status(env: AllocEnv) -> None:
    """§6.1 item 21: the container's devices with their current health."""
    sim = env.sim(R1, 2)
    simple_pod(env.pod_dir, "p", R1, 2)
    assert wait_settled(env.agent, "p")["admitted"]
    sim.control("POST", "/devices/sim-1/unhealthy")
    env.wait_devices(R1, 1)
    status = pods(env.agent)["p"]["containers"][0]["allocatedResourcesStatus"]
    assert status == [{"name": R1, "resources": [{"resourceID": "sim-0", "health": "Healthy"},
                                                 {"resourceID": "sim-1", "health": "Unhealthy"}]}]  # fmt: skip


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
def test_checkpoint_keeps_allocations_across_restart(short_tmp: Path, kill: bool) -> None:
    """§6.1 item 9 (and 17's purpose): admitted pods keep the same devices through an agent restart, without any
    RPC, even while their plugin is away; the checkpoint is a valid kubelet checkpoint holding them."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        sim = env.sim(R1, 4, 2)
        for name in ("a", "b"):
            simple_pod(env.pod_dir, name, R1, 2 if name == "a" else 1)
        before = {n: devices_of(wait_settled(env.agent, n), R1) for n in ("a", "b")}
        assert all(before.values())
        allocate_calls = len(calls(sim, "Allocate"))
        sim.stop()
        env.restart_agent(kill)
        after = {n: wait_settled(env.agent, n) for n in ("a", "b")}
        assert all(p["admitted"] and p["restored"] for p in after.values())
        assert {n: devices_of(p, R1) for n, p in after.items()} == before
        sim = env.sim(R1, 4, 2)
        simple_pod(env.pod_dir, "c", R1, 1)
        c = wait_settled(env.agent, "c")
        assert c["admitted"] and not devices_of(c, R1) & (before["a"] | before["b"])
        assert len(calls(sim, "Allocate")) == 1  # only for c: the restored pods asked nothing
        assert allocate_calls == 2
        env.agent.stop()
        data = decode((env.plugin_dir / "kubelet_internal_checkpoint").read_bytes())
        held = {(e.PodUID, e.ContainerName): e.devices() for e in data.PodDeviceEntries or []}
        assert sorted(map(sorted, held.values())) == sorted(map(sorted, [before["a"], before["b"], devices_of(c, R1)]))


def test_removed_while_down_is_released_after_sync(short_tmp: Path) -> None:
    """§4.8: a pod whose file vanished while the agent was down is freed once the directory has been read."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        env.sim(R1, 2)
        gone = simple_pod(env.pod_dir, "gone", R1, 1)
        simple_pod(env.pod_dir, "kept", R1, 1)
        kept = devices_of(wait_settled(env.agent, "kept"), R1)
        gone_pod = wait_settled(env.agent, "gone")
        assert gone_pod["admitted"]
        gone_devices = devices_of(gone_pod, R1)
        assert gone_devices and not gone_devices & kept
        env.agent.kill()
        gone.unlink()
        env.start_agent()
        assert devices_of(wait_settled(env.agent, "kept"), R1) == kept
        wait_for(lambda: allocated(env, R1) == 1, what="only the kept pod holds a device")
        listed = {d["id"]: d for d in env.wait_devices(R1, 2)["devices"]}
        for device_id in gone_devices:
            assert listed[device_id]["allocatedTo"] is None, listed[device_id]
        assert all(listed[d]["allocatedTo"] is not None for d in kept)


def test_topology_policies(short_tmp: Path) -> None:
    """§4.12 through the agent: aligned when possible; spread only under best-effort; refused with a reason under
    restricted and single-numa-node."""
    for policy, admitted in (("single-numa-node", False), ("restricted", False), ("best-effort", True)):
        root = short_tmp / policy
        with alloc_env(root, "--topology-policy", policy, "--numa-nodes", "2") as env:
            env.start_agent()
            sim = env.sim(R1, 4, 2)  # sim-0, sim-1 on NUMA 0; sim-2, sim-3 on NUMA 1
            simple_pod(env.pod_dir, "aligned", R1, 2)
            assert devices_of(wait_settled(env.agent, "aligned"), R1) in ({"sim-0", "sim-1"}, {"sim-2", "sim-3"})
            Path(env.pod_dir / "aligned.json").unlink()
            wait_for(lambda env=env: allocated(env, R1) == 0, what="released")
            sim.control("POST", "/health", {"sim-0": False, "sim-3": False})  # one healthy device per node
            env.wait_devices(R1, 2)
            simple_pod(env.pod_dir, "spread", R1, 2)
            spread = wait_settled(env.agent, "spread")
            assert spread["admitted"] is admitted, spread
            if admitted:
                assert devices_of(spread, R1) == {"sim-1", "sim-2"}
            else:
                assert spread["reason"].startswith("TopologyAffinityError: Resources cannot be allocated with Topology")
                assert policy in spread["reason"]
                assert allocated(env, R1) == 0


def test_restricted_refuses_one_node_merged_with_two(short_tmp: Path) -> None:
    """The topology manager's merge through the agent, where it differs from ANDing preferences: one device of R1 fits
    either node, two of R2 need both. Node 0 satisfies both, but the hints' masks differ ({0} and {0,1}), so upstream
    does not prefer it: restricted refuses the pod (deviceplane used to admit it), best-effort admits it."""
    for policy, admitted in (("restricted", False), ("best-effort", True)):
        with alloc_env(short_tmp / policy, "--topology-policy", policy, "--numa-nodes", "2") as env:
            env.start_agent()
            env.sim(R1, 2, 2)  # sim-0 on NUMA 0, sim-1 on NUMA 1
            env.sim(R2, 2, 2)
            write_pod(env.pod_dir, "both.json", pod_manifest("both", [container("main", {R1: 1, R2: 2})]))
            settled = wait_settled(env.agent, "both")
            assert settled["admitted"] is admitted, settled
            if admitted:
                assert len(devices_of(settled, R1)) == 1 and devices_of(settled, R2) == {"sim-0", "sim-1"}
            else:
                assert settled["reason"].startswith("TopologyAffinityError: Resources cannot be allocated with")
                assert allocated(env, R1) == 0 and allocated(env, R2) == 0


def test_concurrent_admissions_with_health_flapping(short_tmp: Path) -> None:
    """§6.1 item 20's spirit: many admissions while devices flap; no device is ever given twice."""
    with alloc_env(short_tmp, "--topology-policy", "best-effort", "--numa-nodes", "2") as env:
        env.start_agent()
        sim = env.sim(R1, 16, 2)
        sim.control("PUT", "/flap", {"rate": 200})
        for i in range(24):
            simple_pod(env.pod_dir, f"p{i}", R1, 1 + i % 2)
        settled = [wait_settled(env.agent, f"p{i}") for i in range(24)]
        sim.control("PUT", "/flap", {"rate": 0})
        owners: dict[str, str] = {}
        for p in settled:
            if p["admitted"]:
                for device in devices_of(p, R1):
                    assert device not in owners, (device, owners.get(device), p["name"])
                    owners[device] = p["name"]
        assert owners  # some made it


def test_crash_before_pre_start_restores_nothing_and_pre_start_runs_again(short_tmp: Path) -> None:
    """SIGKILL while PreStartContainer hangs: the pod was not admitted, so nothing of it is durable; after the
    restart it is admitted afresh and its PreStartContainer does run (the kubelet calls it at container start)."""
    with alloc_env(short_tmp) as env:
        env.start_agent()
        sim = env.sim(R1, 2)
        sim.control("PUT", "/faults/PreStartContainer", {"mode": "hang", "seconds": 60})
        simple_pod(env.pod_dir, "p", R1, 1)
        wait_for(lambda: len(calls(sim, "PreStartContainer")) == 1, what="PreStartContainer in flight")
        # A device update forces a checkpoint write while the admission is in flight.
        sim.control("POST", "/devices/sim-1/unhealthy")
        env.wait_devices(R1, 1)
        checkpoint = env.plugin_dir / "kubelet_internal_checkpoint"
        wait_for(lambda: decode(checkpoint.read_bytes()).RegisteredDevices == {R1: ["sim-0"]}, what="checkpoint")
        assert decode(checkpoint.read_bytes()).PodDeviceEntries is None, "an unfinished admission is not durable"
        assert env.agent is not None and not pods(env.agent)["p"]["admitted"]
        sim.control("DELETE", "/faults/PreStartContainer")
        sim.control("POST", "/devices/sim-1/healthy")
        env.restart_agent(True, "--startup-plugin-wait", "10s")  # the sim re-registers after the restart
        p = wait_settled(env.agent, "p")
        assert (p["admitted"], p["restored"], p["reason"]) == (True, False, ""), p
        assert len(calls(sim, "PreStartContainer")) == 2
        assert len(calls(sim, "Allocate")) == 2
