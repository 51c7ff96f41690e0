"""The NodeDevices object against the real API server (found in review): a restored resource without a plugin yet
publishes (a JSON merge patch drops null keys, and the CRD required them: every status write was refused with 422
and /readyz stayed 503), and an edit of the spec is refused (it made every later status write fail, for good)."""

from __future__ import annotations

from typing import Any

from .agent_cluster import api, bound_token, daemonset_pod, node_devices, token_kubeconfig
from .cluster import Cluster, http_json
from .procs import wait_for

GPU = "example.com/gpu"
ND = "/apis/deviceplane.io/v1alpha1/nodedevices"


def capacities(cluster: Cluster, node: str) -> list[Any]:
    return [r["capacity"] for r in ((node_devices(cluster, node) or {}).get("status") or {}).get("resources", [])]


def test_a_restarted_agent_publishes_a_resource_whose_plugin_has_not_returned(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, test_plugins, procs, short_tmp
) -> None:
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="nd-restored")
    token = bound_token(cluster, daemonset_pod(cluster, node))
    kubeconfig = token_kubeconfig(cluster, token, short_tmp("nd-kc") / "agent.kubeconfig")
    flags = ["--grace-period", "300s", "--nodedevices-debounce", "1s"]
    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=node, extra=flags)
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
    plugin.register(GPU)
    wait_for("NodeDevices shows the gpu", lambda: capacities(cluster, node) == [2], procs=[agent.proc])
    plugin.stop()
    procs.stop(agent.proc)
    # The same plugin dir (its checkpoint restores the resource); the plugin stays away. The fixture waits for
    # /readyz, which needs NodeDevices published.
    again = deviceplane_agent(kubeconfig=kubeconfig, node_name=node, extra=flags, plugin_dir=agent.plugin_dir)
    assert [r["plugin"]["endpoint"] for r in http_json(f"{again.url}/api/v1/devices")["resources"]] == [None]
    wait_for(
        "NodeDevices shows the restored resource, 0/0", lambda: capacities(cluster, node) == [0], procs=[again.proc]
    )


def test_the_spec_cannot_be_edited_away_from_its_node(agent_installed: Cluster, node_agent, test_plugins) -> None:
    cluster = agent_installed
    node, agent = node_agent()
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
    plugin.register(GPU)
    wait_for("published", lambda: capacities(cluster, node) == [2], procs=[agent.proc])
    status, out = api(
        cluster, "PATCH", f"{ND}/{node}", {"spec": {"nodeName": "someone-else"}},
        content_type="application/merge-patch+json",
    )  # fmt: skip
    assert status == 422, out
    assert "spec.nodeName must be the object's name" in str(out)
    plugin.devices([["g0", "Healthy"], ["g1", "Unhealthy"]])
    healthy = lambda: ((node_devices(cluster, node) or {}).get("status") or {}).get("healthyCount")  # noqa: E731
    wait_for("NodeDevices still follows the device", lambda: healthy() == 1, timeout=15, procs=[agent.proc])
