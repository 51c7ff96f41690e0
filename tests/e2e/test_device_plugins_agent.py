"""Real Go device plugins (squat/generic-device-plugin, upstream sample-device-plugin) against OUR agent."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from .procs import wait_for

pytestmark = pytest.mark.e2e


def _resource_with(agent, name: str, count: int):
    def check() -> bool:
        r = agent.resource(name)
        return r is not None and r.get("capacity") == count and r.get("healthy") == count

    return check


def test_generic_device_plugin_registers_with_agent(deviceplane_agent, generic_device_plugin, k8s_bin) -> None:
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

    def listed() -> bool:
        return _find_pod(agent.pods(), "sample-user") is not None

    try:
        wait_for("the static pod listed in /api/v1/pods", listed, procs=[agent.proc, plugin], timeout=30)
    except TimeoutError:
        # Static-pod admission is issue 4's (agent core II). Until the agent lists pods from --pod-manifest-dir at
        # all, this is not a regression but an absent feature; once it lists them, everything below is enforced.
        pytest.skip("the agent does not list static pods from --pod-manifest-dir yet (allocation: issue 4)")
    wait_for("the static pod admitted by the agent", admitted, procs=[agent.proc, plugin], timeout=60)
    entry = _find_pod(agent.pods(), "sample-user")
    assert entry is not None
    (app,) = [c for c in entry["containers"] if c["name"] == "app"]
    ids = app["devices"]["example.com/resource"]
    assert len(ids) == 1 and ids[0] in {"Dev-1", "Dev-2"}
    # The sample plugin (re)creates /tmp/<id> inside its Allocate: proof the real plugin answered.
    marker = Path("/tmp") / ids[0]
    assert marker.exists() and marker.stat().st_mtime >= started - 1, f"{marker} was not (re)created by Allocate"
    # Where the agent reports the run options, the plugin's own response must be in them: mount /tmp/<id>.
    text = json.dumps(entry)
    if "mounts" in text:
        assert f"/tmp/{ids[0]}" in text, entry
