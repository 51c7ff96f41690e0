"""Whether publishing to the cluster works, as /readyz and /metrics show it, against the real API server: a write
the node-scoped policy refuses (403), a Node that does not exist yet (404), an API server that stops answering (no
status), and Warning Events the server refuses. The cause was only in the log, /readyz said `... not published yet`
whatever it was, and no series counted a failure."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.required import unavailable

from .agent_cluster import api, bound_token, daemonset_pod, node_devices, token_kubeconfig
from .cluster import Cluster, denying_policy
from .procs import wait_for

GPU = "example.com/gpu"
PUBLISHERS = ("node_status", "nodedevices")
POLICY = "ValidatingAdmissionPolicy 'deviceplane-agent-node-scoped' with binding 'deviceplane-agent-node-scoped'"


def readyz(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def exposition(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the agent's /metrics, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition(url))
        for sample in family.samples
    }


def failures(url: str, publisher: str, code: int) -> float | None:
    key = frozenset({"publisher": publisher, "code": str(code)}.items())
    return samples(url).get(("deviceplane_publish_failures_total", key))


def last_publish(url: str, publisher: str) -> float | None:
    return samples(url).get((f"deviceplane_{publisher}_last_publish_timestamp_seconds", frozenset()))


def promtool_check(text: str) -> None:
    tool = shutil.which("promtool")
    if tool is None:
        unavailable("promtool missing: run `make promtool`")
    done = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_a_refused_write_says_why_in_readyz_and_metrics(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, short_tmp
) -> None:
    """An agent whose token is bound to another node than the one it is told to publish (a DaemonSet pod with a
    wrong NODE_NAME): the policy refuses each write, and /readyz says so for both publishers, not just `not published
    yet`; every refusal is counted under 403, and the usual statuses exist at 0 from the start."""
    cluster = agent_installed
    own, other = kwok_nodes(2, prefix="pub-403")
    token = bound_token(cluster, daemonset_pod(cluster, own))
    kubeconfig = token_kubeconfig(cluster, token, short_tmp("dp-kc") / "agent.kubeconfig")
    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=other, ready=False)
    denied = f"{re.escape(POLICY)} denied request: deviceplane-agent on node {own} may write only the objects of that"
    node_status_refused = re.compile(
        f"node status not published yet: patch node {other} status: 403 Forbidden: "
        f"[^;]*{denied} node, not nodes/status {other}"
    )
    nodedevices_refused = re.compile(
        f"NodeDevices not published yet: create nodedevices {other}: 403 Forbidden: "
        f"[^;]*{denied} node, not nodedevices {other}"
    )

    def says_why() -> bool:
        code, body = readyz(agent.url)
        return code == 503 and bool(node_status_refused.search(body) and nodedevices_refused.search(body))

    wait_for("/readyz naming both refusals", says_why, timeout=30, procs=[agent.proc])
    for publisher in PUBLISHERS:
        assert (failures(agent.url, publisher, 403) or 0) >= 1, publisher
        assert failures(agent.url, publisher, 0) == 0.0, publisher  # made at the start, so increase() sees a first
        assert last_publish(agent.url, publisher) == 0.0, publisher
    assert samples(agent.url)[("deviceplane_pod_events_dropped_total", frozenset())] == 0.0
    promtool_check(exposition(agent.url))


def test_a_node_that_does_not_exist_yet_is_named_and_its_arrival_published(
    agent_installed: Cluster, deviceplane_agent
) -> None:
    """Admin credentials (the node-scoped token needs a pod on an existing node). Until the Node exists, /readyz says
    it is missing, for each publisher; once it does, both publish and the last-publish times are now."""
    cluster = agent_installed
    node = f"pub-404-{os.urandom(3).hex()}"
    agent = deviceplane_agent(kubeconfig=cluster.kubeconfig, node_name=node, ready=False)
    try:

        def says_missing() -> bool:
            code, body = readyz(agent.url)
            return (
                code == 503
                and f"node status not published yet: patch node {node} status: 404 Not Found" in body
                and f"NodeDevices not published yet: node {node} does not exist: NodeDevices/{node} needs it" in body
            )

        wait_for("/readyz naming the missing Node", says_missing, timeout=30, procs=[agent.proc])
        assert (failures(agent.url, "node_status", 404) or 0) >= 1
        assert (failures(agent.url, "nodedevices", 404) or 0) >= 1
        created = time.time()
        cluster.create_node(node)
        wait_for("ready once the Node exists", lambda: readyz(agent.url) == (200, "ok"), timeout=30, procs=[agent.proc])
        for publisher in PUBLISHERS:
            published_at = last_publish(agent.url, publisher)
            assert published_at is not None and created - 1 <= published_at <= time.time(), (publisher, published_at)
    finally:
        cluster.kubectl("delete", "node", node, "--wait=false", "--ignore-not-found", check=False)


def test_an_outage_after_publishing_keeps_readyz_and_counts_the_failures(
    agent_installed: Cluster, node_agent, test_plugins
) -> None:
    """The API server stops answering (SIGSTOP) after both publishers wrote: /readyz stays ok (the agent still serves
    its node; a probe failing on every node at once would only stall DaemonSet rollouts, docs/agent.md), each write
    attempted meanwhile is counted with code 0 (no answer), and the last-publish times move once it is back."""
    cluster = agent_installed
    node, agent = node_agent()
    plugin = test_plugins(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
    plugin.register(GPU)
    wait_for(
        "published",
        lambda: ((node_devices(cluster, node) or {}).get("status") or {}).get("deviceCount") == 2,
        procs=[agent.proc],
    )
    published_before = {p: last_publish(agent.url, p) for p in PUBLISHERS}
    assert all(published_before.values()), published_before

    apiserver = next(p for p in cluster.started if p.name == "kube-apiserver")
    apiserver.popen.send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        plugin.devices([["g0", "Healthy"], ["g1", "Unhealthy"]])  # both publishers have a write to make
        wait_for(
            "a failed attempt by each publisher",
            lambda: all((failures(agent.url, p, 0) or 0) >= 1 for p in PUBLISHERS),
            timeout=45,
            procs=[agent.proc],
        )
        assert readyz(agent.url) == (200, "ok")
        assert {p: last_publish(agent.url, p) for p in PUBLISHERS} == published_before
    finally:
        apiserver.popen.send_signal(signal.SIGCONT)

    def published_again() -> bool:
        return all((last_publish(agent.url, p) or 0) > stopped for p in PUBLISHERS)

    wait_for("both published again", published_again, timeout=90, procs=[agent.proc])
    assert readyz(agent.url) == (200, "ok")


def no_events_in(namespace: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy (and its binding) refusing every Event created in `namespace` (quotas ignore
    Events, so a policy it is)."""
    rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["events"]}
    match = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
    return denying_policy(f"no-events-{namespace}", rule, "true", f"no events in {namespace}", "Forbidden", match)


def test_refused_warning_events_are_counted(agent_installed: Cluster, node_agent, namespace: str) -> None:
    """A Warning Event the API server refuses (here an admission policy) is dropped: the log said so, and now
    `deviceplane_pod_events_dropped_total` counts it."""
    cluster = agent_installed
    node, agent = node_agent()
    policy = no_events_in(namespace)
    for obj in policy:
        cluster.apply(obj)
    try:
        probe = {
            "apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "probe.", "namespace": namespace},
            "involvedObject": {"kind": "Pod", "namespace": namespace, "name": "probe"}, "reason": "Probe",
            "message": "probe",
        }  # fmt: skip
        wait_for(
            "the policy in force",
            lambda: api(cluster, "POST", f"/api/v1/namespaces/{namespace}/events", probe)[0] == 403,
            timeout=30,
        )
        refused_pod(cluster, agent, node, namespace)
    finally:
        for obj in reversed(policy):
            cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found", check=False)


def refused_pod(cluster: Cluster, agent: Any, node: str, namespace: str) -> None:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "refused", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "app", "image": "registry.invalid/app:1", "resources": {"limits": {GPU: "1"}}}],
        },
    }
    assert samples(agent.url)[("deviceplane_pod_events_dropped_total", frozenset())] == 0.0
    cluster.apply(pod)  # no plugin serves the resource: refused, and its Warning Event with it
    wait_for(
        "the refused event counted",
        lambda: samples(agent.url)[("deviceplane_pod_events_dropped_total", frozenset())] == 1.0,
        timeout=30,
        procs=[agent.proc],
    )
