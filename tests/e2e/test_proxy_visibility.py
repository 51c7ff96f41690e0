"""What proxy mode shows of its own link to the kubelet, against the kubelet's real device manager and PodResources
server (our Go harness): whether the kubelet's PodResources answers (the owners shown come from it), and whether each
resource's endpoint is registered with the kubelet.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from deviceplane.core.times import rfc3339
from tests.support.status_table import condition_rows

from .cluster import REPO
from .conftest import Agent, Harness
from .procs import wait_for
from .test_proxy import SIM, admit_app, counts, kubelet_side, metric, start_proxy, start_sim, view


def readyz(agent: Agent) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(agent.url + "/readyz", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def registered(agent: Agent, resource: str) -> tuple[bool | None, float | None]:
    """The resource's `kubeletRegistered` in /api/v1/devices, and its deviceplane_proxy_endpoint_registered."""
    shown = agent.resource(resource)
    flag = shown["plugin"].get("kubeletRegistered") if shown else None
    return flag, metric(agent, "deviceplane_proxy_endpoint_registered", resource_name=resource)


def owners_current(agent: Agent) -> dict[str, Any] | None:
    """The OwnersCurrent condition of /api/v1/devices (NodeDevices' too), or None."""
    return next((c for c in agent.devices()["conditions"] if c["type"] == "OwnersCurrent"), None)


def status_text(agent: Agent) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "deviceplane", "status", "--url", agent.url],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        check=True,
    )
    return done.stdout


def test_readyz_a_metric_and_a_condition_say_when_the_kubelets_pod_resources_stops_answering_and_recover(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """Once listed, the kubelet's PodResources going away left /readyz at 200 "ok", nothing in the metrics and no
    condition: the owners shown (/api/v1/devices, NodeDevices, deviceplane_devices{state="allocated"}) silently went
    stale. Here the kubelet stops (its PodResources socket goes with it) and a new one serves the same socket again."""
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    sim, _control = start_sim(procs, agent.plugin_dir)
    wait_for("sim through the proxy", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
    (held,) = admit_app(h, "holder", SIM, 1)["containers"][0]["devices"][SIM]
    wait_for("owner shown", lambda: view(agent, SIM)[held]["allocatedTo"] is not None, procs=[agent.proc], timeout=5)
    assert readyz(agent) == (200, "ok")
    assert metric(agent, "deviceplane_kubelet_pod_resources_up") == 1.0
    listed = metric(agent, "deviceplane_kubelet_pod_resources_last_list_timestamp_seconds")
    assert listed is not None and abs(listed - time.time()) < 5
    current = owners_current(agent)
    assert current is not None and (current["status"], current["reason"]) == ("True", "PodResourcesListed")
    shown = status_text(agent)
    assert shown.splitlines()[1] == "conditions: all 3 True", shown
    assert condition_rows(shown)["OwnersCurrent"][:3] == ["True", "PodResourcesListed", current["lastTransitionTime"]]
    time.sleep(1.1)  # a later second for the transition time

    procs.stop(h.proc)  # the kubelet goes, and its PodResources socket with it
    wait_for("not ready", lambda: readyz(agent)[0] == 503, procs=[agent.proc], interval=0.05, timeout=5)
    code, why = readyz(agent)
    assert code == 503 and "kubelet PodResources unreachable" in why and "owners are as of its last listing" in why, why
    assert metric(agent, "deviceplane_kubelet_pod_resources_up") == 0.0
    stale = metric(agent, "deviceplane_kubelet_pod_resources_last_list_timestamp_seconds")
    assert stale is not None
    lost = owners_current(agent)
    assert lost is not None and (lost["status"], lost["reason"]) == ("False", "PodResourcesUnreachable"), lost
    # since when and why (the failed call's code), and how old the owners shown are
    assert lost["message"].startswith("kubelet PodResources unreachable since "), lost
    assert "(UNAVAILABLE" in lost["message"] and lost["message"].endswith(f"device owners are as of {rfc3339(stale)}")
    assert lost["lastTransitionTime"] > current["lastTransitionTime"]
    time.sleep(1.0)
    assert metric(agent, "deviceplane_kubelet_pod_resources_last_list_timestamp_seconds") == stale  # not listed
    assert view(agent, SIM)[held]["allocatedTo"] is not None  # the last listing's owners, kept (and named stale)
    assert owners_current(agent) == lost  # a second later: the same message and time (nothing to write again)
    # `deviceplane status` names it above its conditions table, with since when and why (exit 0: the agent answered)
    shown = status_text(agent)
    assert shown.splitlines()[1] == "conditions: 1 of 3 NOT True: OwnersCurrent", shown
    status, reason, since, _age, message = condition_rows(shown)["OwnersCurrent"]
    assert [status, reason, since, message] == ["False", "PodResourcesUnreachable", lost["lastTransitionTime"],
                                                lost["message"]], shown  # fmt: skip

    h2 = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)  # the same socket, served again
    wait_for("ready again", lambda: readyz(agent) == (200, "ok"), procs=[h2.proc, agent.proc], timeout=10)
    assert metric(agent, "deviceplane_kubelet_pod_resources_up") == 1.0
    again = metric(agent, "deviceplane_kubelet_pod_resources_last_list_timestamp_seconds")
    assert again is not None and again > stale
    back = owners_current(agent)
    assert back is not None and (back["status"], back["reason"]) == ("True", "PodResourcesListed"), back
    assert status_text(agent).splitlines()[1] == "conditions: all 3 True"
    assert back["lastTransitionTime"] > lost["lastTransitionTime"]
    # The new kubelet lists no pod (the harness keeps its pods in memory): the owners follow it.
    wait_for("owners relisted", lambda: view(agent, SIM)[held]["allocatedTo"] is None, procs=[agent.proc], timeout=5)


def wait_registered(agent: Agent, state: bool, what: str, harness: Harness | None = None, timeout: float = 10) -> None:
    watched = [agent.proc, *([harness.proc] if harness is not None else [])]
    expected = (state, 1.0 if state else 0.0)
    wait_for(what, lambda: registered(agent, SIM) == expected, procs=watched, interval=0.05, timeout=timeout)


def test_each_resources_registration_with_the_kubelet_is_shown_through_restarts(
    kubelet_harness, deviceplane_agent, procs, short_tmp
) -> None:
    """/api/v1/devices (plugin.kubeletRegistered), `deviceplane status` and deviceplane_proxy_endpoint_registered say
    whether the kubelet has the resource's endpoint: through a kubelet restart, a plugin away (the kubelet keeps the
    endpoint), and a kubelet restart while the plugin is away (not registered until it is back, as directly). The
    kubelet dropping the endpoint itself is in test_proxy.py's near-limit test."""
    kubelet_dir, pod_resources = kubelet_side(short_tmp)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    agent = start_proxy(deviceplane_agent, kubelet_dir, pod_resources)
    sim, _control = start_sim(procs, agent.plugin_dir)
    wait_for("sim through the proxy", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
    wait_registered(agent, True, "registered", h)
    assert "plugin connected, registered with the kubelet" in status_text(agent)

    # The kubelet restarts: not registered while it is away, registered again with the new one.
    procs.stop(h.proc)
    wait_registered(agent, False, "not registered while the kubelet is away")
    assert "plugin connected, NOT registered with the kubelet" in status_text(agent)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    wait_registered(agent, True, "registered with the new kubelet", h, timeout=2)
    assert counts(h, SIM) == (4, 4)

    # The plugin goes away: the kubelet keeps the endpoint (its devices unhealthy), so it stays registered.
    procs.stop(sim)
    wait_for("devices unhealthy in the kubelet", lambda: counts(h, SIM) == (4, 0), procs=[agent.proc], timeout=5)
    assert registered(agent, SIM) == (True, 1.0)
    assert "plugin disconnected, registered with the kubelet" in status_text(agent)

    # The kubelet restarts while the plugin is away: not registered until the plugin is back.
    procs.stop(h.proc)
    h = kubelet_harness(kubelet_dir, pod_resources_socket=pod_resources)
    time.sleep(1.0)  # a kubelet restart is re-registered within 1 s when the plugin is there
    assert registered(agent, SIM) == (False, 0.0)
    assert counts(h, SIM) == (0, 0)
    sim, _control = start_sim(procs, agent.plugin_dir)
    wait_registered(agent, True, "registered once the plugin is back", h)
    wait_for("the plugin's devices", lambda: counts(h, SIM) == (4, 4), procs=[h.proc, agent.proc, sim])
