"""Real Go device plugins (squat/generic-device-plugin, upstream sample-device-plugin) against OUR agent."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .procs import wait_for


def _resource_with(agent, name: str, count: int):
    def check() -> bool:
        r = agent.resource(name)
        return r is not None and r.get("capacity") == count and r.get("healthy") == count

    return check


def test_generic_device_plugin_registers_with_agent(deviceplane_agent, generic_device_plugin) -> None:
    agent = deviceplane_agent()
    plugin = generic_device_plugin(agent.plugin_dir)
    wait_for(
        "squat.ai/null (4 devices) in the agent's /api/v1/devices",
        _resource_with(agent, "squat.ai/null", 4),
        procs=[agent.proc, plugin],
        timeout=60,
    )
    r = agent.resource("squat.ai/null")
    assert r is not None
    assert r["allocatable"] == 4
    ids = [d["id"] for d in r["devices"]]
    assert len(ids) == len(set(ids)) == 4
    assert all(d["health"] == "Healthy" for d in r["devices"])


def test_sample_device_plugin_registers_with_agent(deviceplane_agent, sample_device_plugin) -> None:
    agent = deviceplane_agent()
    plugin = sample_device_plugin(agent.plugin_dir)
    wait_for(
        "example.com/resource (Dev-1, Dev-2) in the agent's /api/v1/devices",
        _resource_with(agent, "example.com/resource", 2),
        procs=[agent.proc, plugin],
        timeout=60,
    )
    r = agent.resource("example.com/resource")
    assert r is not None
    assert sorted(d["id"] for d in r["devices"]) == ["Dev-1", "Dev-2"]
    assert all(d["health"] == "Healthy" for d in r["devices"])


def _find_pod(pods: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for p in pods:
        if p.get("name") == name:
            return p
    return None


def test_sample_plugin_allocation_through_agent_static_pod(deviceplane_agent, sample_device_plugin, short_tmp) -> None:
    """The agent admits a static pod and the real sample plugin's Allocate answers: mount /tmp/<id>."""
    manifests = short_tmp("dp-manifests")
    agent = deviceplane_agent(pod_manifest_dir=manifests)
    plugin = sample_device_plugin(agent.plugin_dir)
    wait_for(
        "example.com/resource registered with the agent",
        _resource_with(agent, "example.com/resource", 2),
        procs=[agent.proc, plugin],
        timeout=60,
    )
    started = time.time()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sample-user", "namespace": "default", "uid": "0b5e8f3c-1d2e-4c55-9a61-5a1f00e2e001"},
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "image": "registry.invalid/none:1",
                    "resources": {"limits": {"example.com/resource": "1"}},
                }
            ]
        },
    }
    (manifests / "sample-user.json").write_text(json.dumps(pod))

    def admitted() -> bool:
        p = _find_pod(agent.pods(), "sample-user")
        return p is not None and p.get("admitted") is True

    wait_for("the static pod admitted by the agent", admitted, procs=[agent.proc, plugin], timeout=60)
    entry = _find_pod(agent.pods(), "sample-user")
    assert entry is not None
    (app,) = [c for c in entry["containers"] if c["name"] == "app"]
    ids = app["devices"]["example.com/resource"]
    assert len(ids) == 1 and ids[0] in {"Dev-1", "Dev-2"}
    # The sample plugin (re)creates /tmp/<id> inside its Allocate: proof the real plugin answered.
    marker = Path("/tmp") / ids[0]
    assert marker.exists() and marker.stat().st_mtime >= started - 1, f"{marker} was not (re)created by Allocate"
    # The plugin's own Allocate response reaches the container's run options: exactly a mount of /tmp/<id>.
    assert "runOptions" in app, f"no runOptions in /api/v1/pods: {entry}"
    mounts = [(m["containerPath"], m["hostPath"]) for m in app["runOptions"]["mounts"]]
    assert mounts == [(f"/tmp/{ids[0]}", f"/tmp/{ids[0]}")], entry

    # Removing the file ends the pod and frees its device.
    (manifests / "sample-user.json").unlink()
    wait_for(
        "the device freed after the manifest is removed",
        lambda: (agent.resource("example.com/resource") or {}).get("allocated") == 0,
        procs=[agent.proc, plugin],
        timeout=60,
    )


def test_agent_and_kubelet_agree_on_sample_plugin_allocation(
    deviceplane_agent, kubelet_harness, sample_device_plugin, short_tmp
) -> None:
    """The same pods, side by side: our agent and the kubelet's real device manager, each with a sample plugin."""
    manifests = short_tmp("dp-manifests")
    agent = deviceplane_agent(pod_manifest_dir=manifests)
    agent_plugin = sample_device_plugin(agent.plugin_dir)
    h = kubelet_harness(short_tmp("kh"))
    kubelet_plugin = sample_device_plugin(h.socket_dir)
    procs = [agent.proc, agent_plugin, h.proc, kubelet_plugin]
    wait_for("agent registration", _resource_with(agent, "example.com/resource", 2), procs=procs)
    wait_for("kubelet registration", lambda: h.capacity()["allocatable"].get("example.com/resource") == 2, procs=procs)

    def pod(name: str, uid: str, init: int, app: int) -> dict[str, Any]:
        def ctr(cname: str, n: int) -> dict[str, Any]:
            return {"name": cname, "image": "i", "resources": {"limits": {"example.com/resource": str(n)}}}

        spec: dict[str, Any] = {"containers": [ctr("app", app)]}
        if init:
            spec["initContainers"] = [ctr("init", init)]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": spec,
        }

    first = pod("first", "6d0c3f59-8a7e-4d1b-9f00-00000000e2e1", init=1, app=2)
    kubelet = h.admit(first)
    assert kubelet["admitted"], kubelet
    (manifests / "first.json").write_text(json.dumps(first))
    wait_for(
        "agent admits first", lambda: (_find_pod(agent.pods(), "first") or {}).get("admitted") is True, procs=procs
    )
    ours = _find_pod(agent.pods(), "first")
    assert ours is not None

    k_ctrs = {c["name"]: c for c in kubelet["containers"]}
    o_ctrs = {c["name"]: c for c in ours["containers"]}
    for name in ("init", "app"):
        k_ids = k_ctrs[name]["devices"]["example.com/resource"]
        o_ids = o_ctrs[name]["devices"]["example.com/resource"]
        assert len(k_ids) == len(o_ids), (name, k_ids, o_ids)
        k_mounts = sorted((m["containerPath"], m["hostPath"]) for m in k_ctrs[name]["runOptions"]["mounts"])
        o_mounts = sorted((m["containerPath"], m["hostPath"]) for m in o_ctrs[name]["runOptions"]["mounts"])
        assert [len(k_mounts), len(o_mounts)] == [len(k_ids), len(o_ids)]
        assert o_mounts == sorted((f"/tmp/{i}", f"/tmp/{i}") for i in o_ids)
    # Init-container devices are reused by the app container, in both.
    for ctrs in (k_ctrs, o_ctrs):
        assert set(ctrs["init"]["devices"]["example.com/resource"]) <= set(
            ctrs["app"]["devices"]["example.com/resource"]
        ), ctrs

    # Both are full: the next pod is refused with the device manager's own error.
    second = pod("second", "6d0c3f59-8a7e-4d1b-9f00-00000000e2e2", init=0, app=1)
    kubelet2 = h.admit(second)
    assert not kubelet2["admitted"]
    (manifests / "second.json").write_text(json.dumps(second))
    wait_for(
        "agent decides on second",
        lambda: bool((_find_pod(agent.pods(), "second") or {}).get("reason")),
        procs=procs,
        timeout=30,
    )
    ours2 = _find_pod(agent.pods(), "second")
    assert ours2 is not None and ours2["admitted"] is False, ours2
    core_error = "requested number of devices unavailable for example.com/resource. Requested: 1, Available: 0"
    assert core_error in kubelet2["message"], kubelet2
    assert core_error in ours2["reason"], (ours2["reason"], kubelet2["message"])
