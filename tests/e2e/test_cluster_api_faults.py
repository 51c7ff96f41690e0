"""The agent's API side through network faults and restarts, against a real API server: a pod watch whose connection
is cut mid-stream or goes silent resumes from its resourceVersion (no relist, no error with a traceback), and a pod
refused again after an agent restart has one Warning Event, counted, as the kubelet's aggregation keeps it.

The faults come from a real TCP proxy between the agent and the API server (tests/support/tcp_proxy.py): it closes
connections as a restarting server does, or stops forwarding without closing, as a connection lost in the network."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import KubeApi, api_client
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.events import warning_event
from deviceplane.agent.kube.pod_watch import ApiPodSource
from deviceplane.core.pods import Pod
from tests.support.tcp_proxy import TcpProxy, idle_pooled_connections, silenced_pooled_connections

from .agent_cluster import bound_token, daemonset_pod, token_kubeconfig
from .cluster import Cluster
from .procs import wait_for

GPU = "example.com/gpu"


@pytest.fixture
def proxy(cluster: Cluster) -> Any:
    p = TcpProxy(cluster.apiserver_port)
    yield p
    p.close()


def agent_kubeconfig(cluster: Cluster, node: str, directory: Path, server: str | None = None) -> Path:
    """A kubeconfig with a token bound to the agent DaemonSet's pod on `node`, for `server` (the API server's own
    address unless given)."""
    path = token_kubeconfig(cluster, bound_token(cluster, daemonset_pod(cluster, node)), directory / "agent.kubeconfig")
    if server is not None:
        config = json.loads(path.read_text())
        config["clusters"][0]["cluster"]["server"] = server
        path.write_text(json.dumps(config))
    return path


def proxied_admin(cluster: Cluster, proxy: TcpProxy, directory: Path) -> KubeApi:
    """The agent's client as admin, through the proxy."""
    assert cluster.pki is not None
    server = f"https://{proxy.address}"
    kubeconfig = cluster.pki.kubeconfig(server, "admin", ("system:masters",), path=directory / "proxied.kubeconfig")
    return KubeApi(api_client(kubeconfig))


def bare_pod(namespace: str, name: str, node: str, limits: dict[str, str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "app", "image": "registry.invalid/app:1"}
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": node, "containers": [container]},
    }


def log_records(log: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The agent's JSON log records, and the lines that are not JSON (a traceback printed raw would be)."""
    records, other = [], []
    for line in log.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            other.append(line)
    return records, other


def admitted(agent: Any, namespace: str, name: str) -> bool:
    return any(p["namespace"] == namespace and p["name"] == name and p["admitted"] for p in agent.pods())


# -- item: a cut watch resumes --------------------------------------------------------------------------------------


def test_watch_cut_mid_stream_resumes_without_relisting(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, short_tmp, proxy: TcpProxy, namespace: str
) -> None:
    """Every connection of the agent closed mid-stream (as an API server restart closes them): the watch read fails
    with urllib3's ProtocolError, which escaped the client unwrapped and reached the pod source's catch-all (an
    ERROR with a traceback, and the resourceVersion dropped: every pod listed again). Now a WARNING, and the watch
    resumes from its version: one list in the whole run, and a pod created afterwards is admitted."""
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="cut")
    kubeconfig = agent_kubeconfig(cluster, node, short_tmp("dp-kc"), server=f"https://{proxy.address}")
    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=node)
    cluster.apply(bare_pod(namespace, "before", node))
    wait_for("the pod before the cut admitted", lambda: admitted(agent, namespace, "before"), procs=[agent.proc])

    assert proxy.cut() >= 1

    def watch_failed() -> list[dict[str, Any]]:
        return [r for r in log_records(agent.proc.log)[0] if r.get("msg") == "pod watch failed; retrying"]

    wait_for("the pod watch to see its connection cut", lambda: bool(watch_failed()), procs=[agent.proc])
    cluster.apply(bare_pod(namespace, "after", node))
    wait_for("the pod after the cut admitted", lambda: admitted(agent, namespace, "after"), procs=[agent.proc])

    records, raw = log_records(agent.proc.log)
    (failure, *_) = watch_failed()
    assert "ProtocolError" in failure["error"] and failure.get("resourceVersion"), failure
    errors = [r for r in records if r.get("level") in ("error", "critical") or "exception" in r]
    assert not errors, errors
    assert not [line for line in raw if "Traceback" in line], raw
    listed = [r for r in records if r.get("msg") == "pods listed"]
    assert len(listed) == 1, f"the watch listed again instead of resuming: {listed}"


# -- item: a silent watch is noticed --------------------------------------------------------------------------------


class Seen:
    """The pod source's sink: which pods it reported (the source under test is the real one, in process)."""

    def __init__(self) -> None:
        self.pods: set[str] = set()
        self.is_synced = False

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        self.pods.add(key)

    def pod_error(self, source: str, key: str, error: str) -> None:
        raise AssertionError(f"{key}: {error}")

    def pod_gone(self, source: str, key: str) -> None:
        self.pods.discard(key)

    def synced(self, source: str) -> None:
        self.is_synced = True


def test_silent_watch_connection_is_noticed_and_resumed(
    cluster: Cluster, proxy: TcpProxy, namespace: str, short_tmp, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch's connection stops carrying anything, without being closed (blackholed in the proxy). A read timeout
    of its own (3 s here; the server ends each watch after 1 s, so a healthy one never reaches it) notices, and the
    watch resumes on a new connection from its resourceVersion: a pod created afterwards is seen, with one list.
    The read timeout was the server's timeout + 90 s, so the agent stayed blind that long (390 s by default)."""
    node = f"silent-{namespace}"  # pods only need a nodeName; no kubelet or agent runs there
    source = ApiPodSource(
        proxied_admin(cluster, proxy, short_tmp("dp-kc")), node, backoff=Backoff(initial=0.1, maximum=0.5),
        watch_timeout=1, read_timeout=3.0,
    )  # fmt: skip
    seen = Seen()
    caplog.set_level("INFO", logger="deviceplane")

    async def until(what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        task = asyncio.create_task(source.run(seen))
        try:
            await until("the pod list", lambda: seen.is_synced, 30)
            await asyncio.to_thread(cluster.apply, bare_pod(namespace, "before", node))
            await until("the pod created before the blackhole", lambda: f"{namespace}/before" in seen.pods, 30)
            connections = proxy.accepted
            assert proxy.blackhole() >= 1
            await asyncio.to_thread(cluster.apply, bare_pod(namespace, "after", node))
            await until("the pod created after the blackhole", lambda: f"{namespace}/after" in seen.pods, 30)
            assert proxy.accepted > connections  # it came on a new connection
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert source.lists == 1, "the watch listed again instead of resuming"
    timeouts = [r for r in caplog.records if "ReadTimeoutError" in str(getattr(r, "error", ""))]
    assert timeouts and all(r.levelname == "WARNING" and not r.exc_info for r in timeouts), caplog.records


# -- requests one after another, without urllib3's retries ---------------------------------------------------------


def test_requests_follow_each_other_on_one_connection(
    cluster: Cluster, proxy: TcpProxy, namespace: str, short_tmp
) -> None:
    """A write's answer left unread made the next request on its connection open another (5 connections for these
    requests) or, with urllib3's retries off, could fail it (ResponseNotReady, when the answer was already
    buffered). Writes, a read, a watch left at its first event and a list, in a row: all succeed, on one
    connection and the watch's own (urllib3 closes a stream left before its end)."""
    api = proxied_admin(cluster, proxy, short_tmp("dp-kc"))
    node = f"reuse-{namespace}"
    sent = []
    for n in range(3):
        event = warning_event(Pod(f"uid-{n}", namespace, f"p{n}", "Pending", (), ()), "Test", "m", node, time.time())
        api.create_event(namespace, event)
        sent.append(event["metadata"]["name"])
    assert api.get_event(namespace, sent[0]) is not None
    api.patch_event(namespace, sent[0], {"count": 2})
    cluster.apply(bare_pod(namespace, "p", node))
    watch = api.watch_pods(node, "0", 60)  # from "0": the pods there now come first, as ADDED
    assert next(watch).type == "ADDED"
    watch.close()  # left with the stream still open, as after an ERROR event or by a cancelled source
    assert len(api.list_pods(node)[0]) == 1
    api.patch_event(namespace, sent[1], {"count": 2})
    assert proxy.accepted == 2


# -- item: one Event per refused pod, counted -----------------------------------------------------------------------


def test_pod_refused_again_after_a_restart_has_one_event_counted_twice(
    agent_installed: Cluster, kwok_nodes, deviceplane_agent, procs, short_tmp, namespace: str
) -> None:
    """The kubelet aggregates a repeated Warning into one Event with a growing count. The agent named each Event
    afresh (generateName), so every restart that refused the pod again added one more with `count: 1`."""
    cluster = agent_installed
    (node,) = kwok_nodes(1, prefix="events")
    kubeconfig = agent_kubeconfig(cluster, node, short_tmp("dp-kc"))
    flags = ["--startup-plugin-wait", "0s"]  # no plugin will serve GPU: refuse at once
    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=node, extra=flags)
    cluster.apply(bare_pod(namespace, "greedy", node, {GPU: "1"}))

    def events() -> list[dict[str, Any]]:
        found = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=greedy")
        return [e for e in found["items"] if e["reason"] == "UnexpectedAdmissionError"]

    wait_for("the refusal's Warning Event", lambda: [e.get("count") for e in events()] == [1], procs=[agent.proc])
    (first,) = events()
    assert first["message"] == f"Allocate failed due to cannot allocate unregistered device {GPU}, which is unexpected"

    procs.stop(agent.proc)
    agent = deviceplane_agent(kubeconfig=kubeconfig, node_name=node, plugin_dir=agent.plugin_dir, extra=flags)
    wait_for(
        "the restarted agent's refusal counted into the same Event",
        lambda: [e.get("count") for e in events()] == [2],
        procs=[agent.proc],
    )
    (again,) = events()
    assert again["metadata"]["name"] == first["metadata"]["name"]
    assert again["firstTimestamp"] == first["firstTimestamp"] and again["lastTimestamp"] >= first["lastTimestamp"]


def test_after_one_request_failed_requests_at_once_do_not_take_the_other_dead_pooled_connections(
    cluster: Cluster, proxy: TcpProxy, tmp_path: Path
) -> None:
    """Connections idle in the client's pool through an outage stay silent after it (tcp_proxy's restore, as after a
    lost NAT entry); urllib3 cannot tell before sending on one. The publishers retrying at once each took one and
    waited out its 15 s read timeout. After the first failure the pool is now dropped, so they dial anew."""
    api = proxied_admin(cluster, proxy, tmp_path)
    silenced_pooled_connections(proxy, lambda: api.core.list_namespace(_preload_content=False), 3)
    with pytest.raises(KubeError, match="ReadTimeoutError"):
        api.get_node("absent")

    async def three_at_once() -> list[BaseException | dict[str, Any] | None]:
        reads = (asyncio.to_thread(api.get_node, "absent") for _ in range(3))
        return await asyncio.gather(*reads, return_exceptions=True)

    started = time.monotonic()
    answers = asyncio.run(three_at_once())
    assert answers == [None, None, None], f"not all answered: {answers!r}"
    assert time.monotonic() - started < 10


def test_after_a_watch_went_silent_requests_at_once_do_not_take_the_other_dead_pooled_connections(
    cluster: Cluster, proxy: TcpProxy, namespace: str, tmp_path: Path
) -> None:
    """A watch whose connection goes silent fails on its read timeout, raised while its stream is read, after the
    request returned: the pool was dropped only on a failed request, so the publishers' requests at once afterwards
    took the pool's other connections, silent since the same outage, each to wait out its 15 s read timeout. Now
    they dial anew."""
    api = proxied_admin(cluster, proxy, tmp_path)
    node = f"quiet-{namespace}"
    cluster.apply(bare_pod(namespace, "p", node))
    idle_pooled_connections(proxy, lambda: api.core.list_namespace(_preload_content=False), 3)
    watch = api.watch_pods(node, "0", 60, read_timeout=1.0)  # from "0": the pod there now comes first, as ADDED
    assert next(watch).type == "ADDED"
    assert proxy.accepted == 3, "the watch did not take a pooled connection"
    assert proxy.blackhole() == 3  # the watch's and the two idle ones
    with pytest.raises(KubeError, match="ReadTimeoutError"):
        for _ in watch:  # what was on its way already (a bookmark), then silence
            pass

    async def three_at_once() -> list[BaseException | dict[str, Any] | None]:
        reads = (asyncio.to_thread(api.get_node, "absent") for _ in range(3))
        return await asyncio.gather(*reads, return_exceptions=True)

    started = time.monotonic()
    answers = asyncio.run(three_at_once())
    elapsed = time.monotonic() - started
    print(f"three reads at once: {elapsed:.2f} s")
    assert answers == [None, None, None], f"not all answered: {answers!r}"
    assert proxy.accepted == 3 + 3, "not each on a new connection"
    assert elapsed < 5, f"{elapsed:.1f} s for three reads at once (a dead connection: 15 s)"
