"""The cluster-mode parts that decide without I/O: kubelet reasons for Events, watch-event decoding, what the pod
source reports for any object, Node status values (gone resources as 0, quantities compared as quantities), backoff;
and the Event queue's retries against a scripted API (faults the real API server cannot produce on demand); a failed
request tried once, against real local sockets (a closed port, a server that hangs up).
(Against a real API server: tests/e2e/test_cluster_agent.py, tests/e2e/test_cluster_publishers.py,
tests/e2e/test_cluster_api_faults.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import KubeApi, api_client, decode_event
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.events import AdmissionEvents, kubelet_reason, warning_event
from deviceplane.agent.kube.node_devices import node_devices_object, without_heartbeat
from deviceplane.agent.kube.node_status import NodeStatusPublisher
from deviceplane.agent.kube.pod_watch import ApiPodSource
from deviceplane.core.pods import Pod
from deviceplane.core.registry import Capacity
from tests.support.procs import free_port


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def pod_set(self, source: str, key: str, pod: Pod) -> None:
        self.calls.append(("set", key))

    def pod_error(self, source: str, key: str, error: str) -> None:
        assert error
        self.calls.append(("error", key))

    def pod_gone(self, source: str, key: str) -> None:
        self.calls.append(("gone", key))

    def synced(self, source: str) -> None:
        self.calls.append(("synced", ""))


def test_kubelet_reasons() -> None:
    failure = "requested number of devices unavailable for a.com/x. Requested: 3, Available: 2"
    assert kubelet_reason(failure) == (
        "UnexpectedAdmissionError",
        f"Allocate failed due to {failure}, which is unexpected",
    )
    topology = "TopologyAffinityError: Resources cannot be allocated with Topology locality: policy ..."
    assert kubelet_reason(topology) == (
        "TopologyAffinityError",
        "Resources cannot be allocated with Topology locality: policy ...",
    )
    pod = Pod("u1", "ns", "p", "Pending", (), ())
    event = warning_event(pod, "R", "M", "node-1", 0.0)
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "ns", "name": "p", "uid": "u1"}
    assert (event["type"], event["reason"], event["message"], event["source"]["host"]) == (
        "Warning",
        "R",
        "M",
        "node-1",
    )


@given(st.text(max_size=200))
def test_decode_event_never_crashes(line: str) -> None:
    try:
        event = decode_event(line, "watch")
    except KubeError:
        return
    assert isinstance(event["type"], str) and isinstance(event["object"], dict)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
pod_like = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries(
            {},
            optional={
                "name": st.sampled_from(["p", "q", "", "Bad_Name"]) | json_values,
                "namespace": st.sampled_from(["ns", ""]) | json_values,
                "uid": st.sampled_from(["u1", "u2"]) | json_values,
            },
        )
        | json_values,
        "spec": st.fixed_dictionaries(
            {}, optional={"containers": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["a", "b"])}))}
        )
        | json_values,
        "status": st.fixed_dictionaries({}, optional={"phase": st.sampled_from(["Running", "Failed", "x"])}),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ADDED", "MODIFIED", "DELETED"]), pod_like), max_size=6))
def test_any_watched_object_is_reported_or_refused(events: list[tuple[str, dict[str, Any]]]) -> None:
    source = ApiPodSource(None, "node-1")  # type: ignore[arg-type]  # _report makes no request
    sink = RecordingSink()
    for kind, obj in events:
        before = len(sink.calls)
        source._report(sink, kind, json.loads(json.dumps(obj)))
        after = sink.calls[before:]
        if kind == "DELETED":
            assert len(after) <= 1 and all(c[0] == "gone" for c in after)
        else:
            assert len(after) == 1 and after[0][0] in ("set", "error")


def test_node_status_keeps_gone_resources_at_zero() -> None:
    current = Capacity({"a.com/x": 2, "b.com/y": 1}, {"a.com/x": 1, "b.com/y": 1})
    publisher = NodeStatusPublisher(None, "n", lambda: current)  # type: ignore[arg-type]
    assert publisher.wanted() == {
        "capacity": {"a.com/x": "2", "b.com/y": "1"},
        "allocatable": {"a.com/x": "1", "b.com/y": "1"},
    }
    current = Capacity({"b.com/y": 1}, {"b.com/y": 0})  # a.com/x deleted after its grace period
    assert publisher.wanted() == {
        "capacity": {"a.com/x": "0", "b.com/y": "1"},
        "allocatable": {"a.com/x": "0", "b.com/y": "0"},
    }


def test_node_status_patch_zeroes_stale_extended_resources_it_does_not_publish() -> None:
    """On a recreated node the first patch also zeroes the extended resources found there; one a plugin serves
    again is written with its count, not 0."""
    from deviceplane.agent.kube.node_status import extended_resources

    node = {"status": {"capacity": {"cpu": "4", "hugepages-2Mi": "0", "a.com/x": "4", "o.io/y": "2"}}}
    publisher = NodeStatusPublisher(None, "n", lambda: Capacity({"a.com/x": 2}, {"a.com/x": 1}))  # type: ignore[arg-type]
    publisher._stale = extended_resources(node)
    assert publisher._stale == {"a.com/x", "o.io/y"}
    assert publisher.patch(publisher.wanted()) == {
        "capacity": {"a.com/x": "2", "o.io/y": "0"},
        "allocatable": {"a.com/x": "1", "o.io/y": "0"},
    }


@pytest.mark.parametrize(
    ("seen", "differs"),
    [("1k", False), ("1000", False), ("999", True), ("1Ki", True), ("2k", True), (None, True), ("1.5", True),
     ("500m", True), ("garbage", True)],
)  # fmt: skip
def test_read_back_compares_quantities_not_strings(seen: Any, differs: bool) -> None:
    """The API server stores 1000 as "1k": that is no difference. What cannot be parsed as a whole-number quantity
    counts as one (it is rewritten)."""
    from deviceplane.agent.kube.node_status import quantity_differs

    assert quantity_differs("1000", seen) is differs


def test_node_devices_object_is_owned_by_its_node() -> None:
    obj = node_devices_object({"metadata": {"name": "n1", "uid": "uid-1"}})
    assert obj["metadata"]["name"] == "n1" and obj["spec"] == {"nodeName": "n1"}
    assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}]
    status = {"resources": [], "agent": {"version": "v", "node": "n1", "lastHeartbeatTime": "t"}}
    assert without_heartbeat(status) == {"resources": [], "agent": {"version": "v", "node": "n1"}}


def test_a_condition_that_turns_alone_is_a_change_to_write_its_time_alone_is_not() -> None:
    """OwnersCurrent (proxy mode) turns False while no resource changes: the publisher must see a change to write.
    A transition time the view judged alone is none (the publisher writes its own, kept across restarts)."""
    agent = {"version": "v", "node": "n1", "lastHeartbeatTime": "t"}
    current = {"type": "OwnersCurrent", "status": "True", "reason": "r", "message": "m", "lastTransitionTime": "t0"}
    status = {"resources": [], "agent": agent, "conditions": [current]}
    lost = {**current, "status": "False", "reason": "PodResourcesUnreachable", "lastTransitionTime": "t1"}
    assert without_heartbeat(status) != without_heartbeat({**status, "conditions": [lost]})
    later = {**current, "lastTransitionTime": "t5"}
    assert without_heartbeat(status) == without_heartbeat({**status, "conditions": [later]})


@pytest.mark.parametrize("rng", [lambda: 0.0, lambda: 1.0])
def test_backoff_grows_to_its_cap_and_resets(rng: Any) -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, rng=rng)
    delays = [backoff.delay() for _ in range(6)]
    scale = 0.8 if rng() == 0.0 else 1.0
    assert delays == [scale * d for d in (1, 2, 4, 8, 8, 8)]
    backoff.reset()
    assert backoff.delay() == scale * 1.0


# -- Warning Events: retried while queued ---------------------------------------------------------------------------
# A scripted API: the real API server cannot be made to answer 429 or 503 on demand, nor to refuse connections for a
# while and come back (the e2e test_api_server_outage SIGSTOPs it: requests hang until their timeout instead).


def fast_backoff() -> Backoff:
    return Backoff(initial=0.01, maximum=0.05)  # the agent's 0.5 s -> 10 s, scaled down


class ScriptedApi:
    """create_event fails with each status of `failures` in turn (0: unreachable), then succeeds; `down` makes every
    call fail as an unreachable server does until it is cleared. get_event finds nothing: after a scripted 409 the
    event expired before it was read, a race the real server offers once an hour (its Event TTL)."""

    def __init__(self, failures: tuple[int, ...] = ()) -> None:
        self.failures = list(failures)
        self.down = False
        self.calls = 0
        self.reads = 0
        self.created: list[str] = []  # the pods whose events were created, in order

    def get_event(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return None

    def create_event(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls += 1
        if self.down:
            raise KubeError("create event: MaxRetryError: connection refused", 0)
        if self.failures:
            status = self.failures.pop(0)
            raise KubeError(f"create event: {status}", status)
        self.created.append(body["involvedObject"]["name"])


def api_pod(name: str) -> Pod:
    return Pod(f"uid-{name}", "ns", name, "Pending", (), ())


async def poll(until: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if until():
            return
        await asyncio.sleep(0.01)


def run_events(events: AdmissionEvents, until: Callable[[], bool]) -> None:
    """Run the Event sender until `until()` holds (or 10 s), then stop it."""

    async def main() -> None:
        task = asyncio.create_task(events.run())
        await poll(until)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_event_is_retried_through_an_outage_however_long() -> None:
    """Unreachable (status 0), 429 and 5xx are retried for as long as the event is queued: far more attempts than a
    fixed budget would allow (the agent used to drop an event after 5 attempts, ~7.5 s of API server restart)."""
    api = ScriptedApi(failures=(0,) * 30 + (503, 500, 429, 504))
    events = AdmissionEvents(api, "n1", backoff=fast_backoff())  # type: ignore[arg-type]
    events.failed("api", api_pod("p1"), "requested number of devices unavailable")
    run_events(events, lambda: events.queued == 0)
    assert api.created == ["p1"] and api.calls == 35
    assert (events.sent, events.dropped) == (1, 0)


@pytest.mark.parametrize("status", [400, 403, 404, 422])
def test_event_refused_by_the_server_is_dropped_and_the_next_sent(status: int) -> None:
    """A 4xx other than 429 (and 409, below) will not succeed on retry: that event is dropped at once, the next one
    goes out."""
    api = ScriptedApi(failures=(status,))
    events = AdmissionEvents(api, "n1", backoff=fast_backoff())  # type: ignore[arg-type]
    events.failed("api", api_pod("refused"), "x")
    events.failed("api", api_pod("next"), "x")
    run_events(events, lambda: events.queued == 0)
    assert api.created == ["next"] and api.calls == 2
    assert (events.sent, events.dropped) == (1, 1)


def test_event_that_expires_between_conflict_and_read_is_created_again() -> None:
    """409: the pod's event exists (a repeat: it is read and counted, tests/e2e/test_cluster_api_faults.py). Gone by
    the time it is read (expired): created afresh, not dropped; and a second 409 after that gives up, bounded."""
    api = ScriptedApi(failures=(409,))
    events = AdmissionEvents(api, "n1", backoff=fast_backoff())  # type: ignore[arg-type]
    events.failed("api", api_pod("p1"), "x")
    run_events(events, lambda: events.queued == 0)
    assert (api.created, api.reads, events.sent, events.repeats, events.dropped) == (["p1"], 1, 1, 0, 0)

    api = ScriptedApi(failures=(409, 409))
    events = AdmissionEvents(api, "n1", backoff=fast_backoff())  # type: ignore[arg-type]
    events.failed("api", api_pod("p1"), "x")
    run_events(events, lambda: events.queued == 0)
    assert (api.created, api.calls, events.sent, events.dropped) == ([], 2, 0, 1)


def test_event_name_is_one_per_pod_and_reason_and_a_valid_name() -> None:
    """A repeat must find the event by name: the same pod UID and reason give the same name, across processes (no
    salt); another UID (the pod re-created) or reason, another. The longest pod name still makes a valid one."""
    import re

    from deviceplane.agent.kube.events import event_name

    pod = api_pod("p1")
    assert event_name(pod, "A") == event_name(Pod(pod.uid, "ns", "p1", "Running", (), ()), "A")
    assert len({event_name(pod, "A"), event_name(pod, "B"), event_name(api_pod("p2"), "A")}) == 3
    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    for name in ("p1", "a" * 253, "a" * 235 + "-b" + "c" * 16, "a" * 235 + ".b" + "c" * 16):
        made = event_name(Pod("u", "ns", name, "Pending", (), ()), "UnexpectedAdmissionError")
        assert len(made) <= 253 and subdomain.fullmatch(made), made


def test_event_queue_stays_bounded_while_the_server_is_away() -> None:
    """While the server is away the queue holds the newest `max_queued` events; older ones (the one being retried
    included) are dropped and counted. Once the server is back the kept ones go out in order."""
    api = ScriptedApi()
    api.down = True
    events = AdmissionEvents(api, "n1", backoff=fast_backoff(), max_queued=3)  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.create_task(events.run())
        for name in ("e1", "e2", "e3", "e4", "e5"):
            events.failed("api", api_pod(name), "x")
            await asyncio.sleep(0.05)  # the sender is retrying the oldest meanwhile
        assert api.calls > 1 and events.queued == 3
        api.down = False
        await poll(lambda: events.queued == 0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert api.created == ["e3", "e4", "e5"]
    assert (events.sent, events.dropped, events.queued) == (3, 2, 0)


def test_events_of_other_sources_are_not_recorded() -> None:
    events = AdmissionEvents(ScriptedApi(), "n1")  # type: ignore[arg-type]
    events.failed("file", api_pod("static"), "x")
    assert events.queued == 0


def test_a_publisher_without_debounce_polls_at_a_floor_not_in_a_busy_loop() -> None:
    """`--nodedevices-debounce 0` is accepted; the publisher then polled the allocation counter in a busy loop
    (~110,000 times a second, a whole CPU) while nothing changed (found in review)."""
    from deviceplane.agent.cli import duration
    from deviceplane.agent.kube.node_devices import ALLOCATION_POLL_FLOOR_SECONDS, NodeDevicesPublisher
    from deviceplane.api.models import AgentView, DevicesStatus

    polls = 0

    def allocations() -> int:
        nonlocal polls
        polls += 1
        return 0

    class Api:  # only the object's existence and the status write are asked: a fault-free stand-in
        def get_node_devices(self, name: str) -> dict[str, Any]:
            return {"metadata": {"name": name}}

        def patch_node_devices_status(self, name: str, status: dict[str, Any]) -> None:
            pass

    def status(_limit: int) -> DevicesStatus:
        return DevicesStatus(resources=[], agent=AgentView(version="0", node="n", lastHeartbeatTime="t"))

    async def idle_polls(seconds: float) -> int:
        publisher = NodeDevicesPublisher(Api(), "n", status, allocations=allocations, debounce=duration("0"))  # type: ignore[arg-type]
        task = asyncio.create_task(publisher.run())
        await asyncio.sleep(0.3)  # the first write; nothing changes after it
        before = polls
        await asyncio.sleep(seconds)
        task.cancel()
        return polls - before

    assert asyncio.run(idle_polls(1.0)) <= 2 / ALLOCATION_POLL_FLOOR_SECONDS


def test_a_bracketed_ipv6_http_address_is_served() -> None:
    """`--http-addr [::1]:9450` passes the flag's check but the brackets reached the socket layer (found in review)."""
    from deviceplane.agent.cli import http_address
    from deviceplane.agent.serving.lean_http import LeanHttpServer

    async def serve_and_stop() -> None:
        server = LeanHttpServer({})
        await server.start(http_address("[::1]:0"))
        assert server.port > 0
        await server.close()

    asyncio.run(serve_and_stop())


# -- one retry policy: the agent's backoff, not urllib3's -----------------------------------------------------------


class HangUp:
    """A real TCP server that closes every connection it accepts, before the TLS handshake: a server failing every
    request. Counts the connections."""

    def __init__(self) -> None:
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._listener.close()


def kubeconfig_for(port: int, path: Path) -> Path:
    cluster = {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("server", ["closed port", "hangs up"])
def test_a_failed_request_is_tried_once_and_logged_once(
    server: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """urllib3 retried every failed request 3 times before the agent's own backoff, each time with a WARNING of its
    own (69 in a 30 s outage), and against a server dropping packets waited 4 connect timeouts (~20 s). One try now,
    and the one line is the agent's."""
    hang_up = HangUp() if server == "hangs up" else None
    port = hang_up.port if hang_up is not None else free_port()
    source = ApiPodSource(KubeApi(api_client(kubeconfig_for(port, tmp_path / "kubeconfig"))), "n1", Backoff(60.0))
    caplog.set_level(logging.WARNING)

    async def first_failure() -> float:
        started = time.monotonic()
        task = asyncio.create_task(source.run(RecordingSink()))
        await poll(lambda: bool(caplog.records), timeout=30.0)
        took = time.monotonic() - started
        await asyncio.sleep(0.3)  # anything logged late would show
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return took

    try:
        took = asyncio.run(first_failure())
    finally:
        if hang_up is not None:
            hang_up.close()
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [("deviceplane.kube.pods", "WARNING", "pod watch failed; retrying")], lines
    assert took < 2.0
    if hang_up is not None:
        assert hang_up.accepted == 1
