"""podDevices bookkeeping (spec §6.3) and its checkpoint form (§6.1 item 9 TestCheckpoint)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.checkpoint import checkpoint_data_for_write, decode, encode
from deviceplane.core.pod_devices import DeviceInstance, PodDevices, make_allocation


def resp(**kw: object) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(**kw)  # type: ignore[arg-type]


def test_get_container_devices_device_on_two_numa_nodes() -> None:
    """TestGetContainerDevices: dev1 on NUMA 0 and 1 -> one row per node."""
    pds = PodDevices()
    pds.insert(make_allocation("pod1", "ctr1", "foo", {0: ("dev1",), 1: ("dev1",)}, resp()))
    assert pds.device_instances("pod1", "ctr1") == [DeviceInstance("foo", "dev1", 0), DeviceInstance("foo", "dev1", 1)]


def test_no_topology_devices_have_no_numa_row() -> None:
    pds = PodDevices()
    pds.insert(make_allocation("p", "c", "foo", {-1: ("a",), 0: ("b",)}, resp()))
    assert pds.device_instances("p", "c") == [DeviceInstance("foo", "a", None), DeviceInstance("foo", "b", 0)]
    assert pds.device_instances("p", "missing") == []


def test_pod_and_container_devices_union() -> None:
    """TestPodDevices (pod-level union, 4) and TestContainerDevices (across NUMA keys, 3)."""
    pds = PodDevices()
    pds.insert(make_allocation("pod1", "c1", "r", {0: ("d1", "d2")}, resp()))
    pds.insert(make_allocation("pod1", "c2", "r", {-1: ("d3",), 1: ("d4",)}, resp()))
    assert pds.pod_devices("pod1", "r") == {"d1", "d2", "d3", "d4"}
    pds.insert(make_allocation("pod2", "c", "r", {-1: ("e1",), 0: ("e2",), 1: ("e3",)}, resp()))
    assert pds.container_devices("pod2", "c", "r") == {"e1", "e2", "e3"}
    assert pds.container_devices("pod2", "other", "r") is None


def test_holder_of_a_device() -> None:
    """TestGetPodAndContainerForDevice."""
    pds = PodDevices()
    pds.insert(make_allocation("pod1", "c", "r", {0: ("dev1",)}, resp()))
    assert pds.holder("r", "dev1") == ("pod1", "c")
    assert pds.holder("r", "unknown") is None and pds.holder("other", "dev1") is None


def test_shared_device_is_shown_held_by_the_smallest_container_name() -> None:
    pds = PodDevices()
    pds.insert(make_allocation("p", "setup", "r", {0: ("d1", "d2")}, resp()))  # a regular init container
    pds.insert(make_allocation("p", "app", "r", {0: ("d1",)}, resp()))  # reuses d1
    pds.insert(make_allocation("p", "zz", "r", {0: ("d2",)}, resp()))  # reuses d2
    assert (pds.holder("r", "d1"), pds.holder("r", "d2")) == (("p", "app"), ("p", "setup"))
    assert pds.holders("r", "d2") == {("p", "setup"), ("p", "zz")}
    pds.remove_pod("p")
    assert pds.holder("r", "d1") is None and pds.holders("r", "d1") == set() and pds.allocated("r") == set()


# (insert or remove, pod, container, resource, devices): few names, so entries replace and share devices often
HOLDER_CHANGES = st.tuples(
    st.booleans(),
    st.sampled_from("pq"),
    st.sampled_from(["c1", "c2", "c3"]),
    st.sampled_from(["a", "b"]),
    st.frozensets(st.sampled_from(["d1", "d2", "d3"]), max_size=3),
)


@settings(max_examples=300)
@given(st.lists(HOLDER_CHANGES, max_size=40))
def test_the_holder_index_agrees_with_walking_every_entry(
    changes: list[tuple[bool, str, str, str, frozenset[str]]],
) -> None:
    """The index kept on each insert and removal (one holder, or a set of several) against the entries walked: who
    holds each device, which one the views show (the smallest pair), what is allocated and how many."""
    pds = PodDevices()
    for insert, pod, container, resource, devices in changes:
        if insert:
            pds.insert(make_allocation(pod, container, resource, {0: tuple(sorted(devices))}, resp()))
        else:
            pds.remove_pod(pod)
        walked: dict[tuple[str, str], set[tuple[str, str]]] = {}
        for uid in pds.pods():
            for allocation in pds.allocations(uid):
                for device_id in allocation.device_ids:
                    walked.setdefault((allocation.resource, device_id), set()).add((uid, allocation.container))
        for resource in ("a", "b"):
            held = {device for (r, device) in walked if r == resource}
            assert pds.allocated(resource) == held and pds.allocated_count(resource) == len(held)
            for device_id in ("d1", "d2", "d3", "d4"):
                expected = walked.get((resource, device_id), set())
                assert pds.holders(resource, device_id) == expected
                assert pds.holder(resource, device_id) == (min(expected) if expected else None)
                assert pds.holds(resource, device_id) == bool(expected)
        assert pds.devices() == {r: {d for (rr, d) in walked if rr == r} for r in {r for r, _ in walked}}


def test_run_options_of_unknown_container_is_none_and_cdi_merged() -> None:
    pds = PodDevices()
    pds.insert(make_allocation("p", "c", "a", {-1: ("1",)}, resp(cdi_devices=[pb.CDIDevice(name="x=1")])))
    pds.insert(
        make_allocation(
            "p", "c", "b", {-1: ("2",)}, resp(cdi_devices=[pb.CDIDevice(name="x=1"), pb.CDIDevice(name="y=2")])
        )
    )
    assert pds.run_options("p", "nope") is None
    options = pds.run_options("p", "c", order=["b", "a"])
    assert options is not None and options.cdi_devices == ["x=1", "y=2"]


def test_checkpoint_round_trip() -> None:
    """TestCheckpoint: 5 entries (env, mount, device, CDI responses, one NUMA -1) survive write and read."""
    pds = PodDevices()
    pds.insert(
        make_allocation(
            "pod1",
            "con1",
            "domain1.com/resource1",
            {0: ("dev1", "dev2")},
            resp(envs={"A": "1"}, mounts=[pb.Mount(container_path="/m", host_path="/h")]),
        )
    )
    pds.insert(
        make_allocation(
            "pod1",
            "con1",
            "domain2.com/resource2",
            {1: ("dev3",)},
            resp(devices=[pb.DeviceSpec(container_path="/dev/a", host_path="/dev/a")]),
        )
    )
    pds.insert(
        make_allocation(
            "pod1", "con2", "domain1.com/resource1", {0: ("dev4",)}, resp(cdi_devices=[pb.CDIDevice(name="v.com/d=1")])
        )
    )
    pds.insert(make_allocation("pod2", "con1", "domain1.com/resource1", {-1: ("dev5",)}, resp()))
    pds.insert(make_allocation("pod3", "con1", "domain3.com/resource3", {0: ("dev6",), 1: ("dev7",)}, resp()))
    healthy = {
        "domain1.com/resource1": {"dev1", "dev2", "dev4", "dev5"},
        "domain2.com/resource2": {"dev3"},
        "domain3.com/resource3": set(),
    }
    data = decode(encode(checkpoint_data_for_write(pds.entries(), healthy)))
    restored = PodDevices()
    assert restored.load(data.PodDeviceEntries or []) == 0
    assert len(restored) == 5
    for pod_uid in ("pod1", "pod2", "pod3"):
        for container in ("con1", "con2"):
            for resource in healthy:
                assert restored.container_devices(pod_uid, container, resource) == pds.container_devices(
                    pod_uid, container, resource
                )
    assert restored.devices() == pds.devices()
    options = restored.run_options("pod1", "con1")
    assert options is not None and len(options.envs) == 1 and len(options.mounts) == 1 and len(options.devices) == 1
    assert data.RegisteredDevices == {k: sorted(v) for k, v in healthy.items()}


def test_unreadable_alloc_resp_entries_are_skipped() -> None:
    entry = make_allocation("p", "c", "r", {-1: ("a",)}, resp()).entry
    broken = type(entry)(entry.PodUID, entry.ContainerName, entry.ResourceName, entry.DeviceIDs, b"\xff\xff")
    pds = PodDevices()
    assert pds.load([broken, entry]) == 1
    assert pds.container_devices("p", "c", "r") == {"a"}


def test_run_option_conflicts_within_one_response_and_across_resources() -> None:
    """The cheap path (no merge) is only taken where nothing can conflict; conflicts inside one response (two mounts
    or devices at one container path) and across resources are still found."""
    pds = PodDevices()
    one = resp(envs={"A": "1"}, mounts=[pb.Mount(container_path="/m", host_path="/h1")],
               devices=[pb.DeviceSpec(container_path="/dev/x", host_path="/dev/a")])  # fmt: skip
    pds.insert(make_allocation("p", "plain", "r1", {0: ("a",)}, one))
    assert pds.run_option_conflicts("p", "plain") == []
    twice = resp(
        mounts=[pb.Mount(container_path="/m", host_path="/h1"), pb.Mount(container_path="/m", host_path="/h2")]
    )
    pds.insert(make_allocation("p", "inside", "r1", {0: ("b",)}, twice))
    assert pds.run_option_conflicts("p", "inside") == [
        "Container path /m has conflicting mount host paths: /h1 and /h2 (from r1)"
    ]
    pds.insert(make_allocation("p", "across", "r1", {0: ("c",)}, resp(envs={"A": "1"})))
    pds.insert(make_allocation("p", "across", "r2", {0: ("d",)}, resp(envs={"A": "2"})))
    assert pds.run_option_conflicts("p", "across", ["r1", "r2"]) == [
        "Environment variable A has conflicting setting: 1 and 2 (from r2)"
    ]
    assert pds.run_option_conflicts("p", "missing") == []


# (insert or remove, pod, container, resource)
CHANGES = st.tuples(st.booleans(), st.sampled_from("pqrs"), st.sampled_from(["c1", "c2"]), st.sampled_from(["a", "b"]))


@settings(max_examples=200)
@given(st.lists(CHANGES, max_size=30), st.sets(st.sampled_from("pqrsz")))
def test_entries_are_in_the_order_first_made_and_leave_out_the_pods_asked(
    changes: list[tuple[bool, str, str, str]], left_out: set[str]
) -> None:
    """Against a list kept by hand: an insert of a new (pod, container, resource) appends its entry, a replacement
    keeps the place, a removed pod's entries go; `without_pods` leaves out those pods' entries (an unknown pod too)."""
    pds = PodDevices()
    expected: list[tuple[str, str, str]] = []
    made: dict[tuple[str, str, str], object] = {}
    for serial, (insert, pod, container, resource) in enumerate(changes):
        if insert:
            allocation = make_allocation(pod, container, resource, {0: (f"d{serial}",)}, resp())
            pds.insert(allocation)
            if (pod, container, resource) not in made:
                expected.append((pod, container, resource))
            made[(pod, container, resource)] = allocation.entry
        else:
            pds.remove_pod(pod)
            expected = [key for key in expected if key[0] != pod]
            made = {key: entry for key, entry in made.items() if key[0] != pod}
    assert pds.entries() == [made[key] for key in expected]
    assert pds.entries(without_pods=left_out) == [made[key] for key in expected if key[0] not in left_out]


def test_a_null_alloc_resp_is_an_empty_response_and_its_devices_stay_held() -> None:
    """Upstream fromCheckpointData unmarshals a null AllocResp (nil bytes) into an empty response without error and
    keeps the entry; skipping it would leave its devices free to be given twice."""
    entry = make_allocation("p", "c", "r", {-1: ("a",)}, resp()).entry
    null = type(entry)(entry.PodUID, entry.ContainerName, entry.ResourceName, entry.DeviceIDs, None)
    pds = PodDevices()
    assert pds.load([null]) == 0
    assert pds.container_devices("p", "c", "r") == {"a"}
    options = pds.run_options("p", "c")
    assert options is not None and not options.envs and not options.mounts and not options.devices
    # Written back as upstream re-marshals an empty response, so a second restart still holds the device.
    raw = encode(checkpoint_data_for_write(pds.entries(), {"r": ["a"]}))
    assert b'"AllocResp":""' in raw
    again = PodDevices()
    assert again.load(decode(raw).PodDeviceEntries or []) == 0
    assert again.container_devices("p", "c", "r") == {"a"}
