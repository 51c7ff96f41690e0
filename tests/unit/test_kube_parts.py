"""The cluster-mode parts that decide without I/O: kubelet reasons for Events, watch-event decoding, what the pod
source reports for any object, Node status values (gone resources as 0), backoff. (Against a real API server:
tests/e2e/test_cluster_agent.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.agent.kube.backoff import Backoff
from deviceplane.agent.kube.client import decode_event
from deviceplane.agent.kube.errors import KubeError
from deviceplane.agent.kube.events import kubelet_reason, warning_event
from deviceplane.agent.kube.node_devices import node_devices_object, without_heartbeat
from deviceplane.agent.kube.node_status import NodeStatusPublisher
from deviceplane.agent.kube.pod_watch import ApiPodSource
from deviceplane.core.pods import Pod
from deviceplane.core.registry import Capacity


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


def test_node_devices_object_is_owned_by_its_node() -> None:
    obj = node_devices_object({"metadata": {"name": "n1", "uid": "uid-1"}})
    assert obj["metadata"]["name"] == "n1" and obj["spec"] == {"nodeName": "n1"}
    assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}]
    status = {"resources": [], "agent": {"version": "v", "node": "n1", "lastHeartbeatTime": "t"}}
    assert without_heartbeat(status) == {"resources": [], "agent": {"version": "v", "node": "n1"}}


@pytest.mark.parametrize("rng", [lambda: 0.0, lambda: 1.0])
def test_backoff_grows_to_its_cap_and_resets(rng: Any) -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, rng=rng)
    delays = [backoff.delay() for _ in range(6)]
    scale = 0.8 if rng() == 0.0 else 1.0
    assert delays == [scale * d for d in (1, 2, 4, 8, 8, 8)]
    backoff.reset()
    assert backoff.delay() == scale * 1.0
