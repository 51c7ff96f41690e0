"""Fuzzing what a plugin answers: a lying or odd plugin (tests/support/testplugin.py, a real gRPC server in its own
process) answers Allocate and GetPreferredAllocation with arbitrary well-formed messages: no container response or
several, envs, mounts, device specs, annotations and CDI devices of any text (empty, huge, unicode, NUL), fields this
protocol version does not know, preferred IDs that were never offered, repeated, too many or too few.

Each pod is admitted through `--debug-admit-api` and must settle as the kubelet would: admitted when the Allocate
answer has a container response (the first one counts, as upstream), else refused with upstream's message; never an
internal error. An admitted pod's devices are distinct healthy devices of the plugin, one set per container as asked,
the same in /api/v1/pods, in the PodResources API and in the kubelet-format checkpoint, whose AllocResp is the first
container response the plugin sent (as a message), unknown fields included. Removing the pod frees every device, and
a refused pod holds none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.checkpoint import decode
from tests.fuzz.conftest import DEVICES, RESOURCE, assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.pods import PodResourcesClient, listed_devices
from tests.support.procs import AgentProcess, TestPlugin, free_port, wait_for
from tests.support.raw_http import exchange, responses

DEVICE_IDS = {device[0] for device in DEVICES}
CHECKPOINT = "kubelet_internal_checkpoint"

TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "=", "a=b", "\x00", "\u00e9\u4e2d", "../../etc/passwd", "/dev/null", "x" * 5000]),
)


@st.composite
def container_responses(draw: st.DrawFn) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=draw(st.dictionaries(TEXT, TEXT, max_size=3)),
        mounts=[
            pb.Mount(container_path=draw(TEXT), host_path=draw(TEXT), read_only=draw(st.booleans()))
            for _ in range(draw(st.integers(0, 2)))
        ],
        devices=[
            pb.DeviceSpec(container_path=draw(TEXT), host_path=draw(TEXT), permissions=draw(TEXT))
            for _ in range(draw(st.integers(0, 2)))
        ],
        annotations=draw(st.dictionaries(TEXT, TEXT, max_size=2)),
        cdi_devices=[pb.CDIDevice(name=draw(TEXT)) for _ in range(draw(st.integers(0, 2)))],
    )


# A field number this version of the protocol does not define (a newer plugin's), length-delimited: field 99.
UNKNOWN_FIELD = b"\x9a\x06\x03new"


@st.composite
def allocate_answers(draw: st.DrawFn) -> tuple[bytes, bool] | None:
    """A serialized AllocateResponse, and whether its first container response carries an unknown field; None: the
    plugin's default answer (a container response per container request)."""
    if draw(st.integers(0, 5)) == 0:
        return None
    answers = draw(st.lists(container_responses(), max_size=3))
    unknown_in_first = bool(answers) and draw(st.booleans())
    if unknown_in_first:  # parsed back, the message keeps the field and serializes it again
        answers[0] = pb.ContainerAllocateResponse.FromString(answers[0].SerializeToString() + UNKNOWN_FIELD)
    body = pb.AllocateResponse(container_responses=answers).SerializeToString()
    return body + (UNKNOWN_FIELD if draw(st.booleans()) else b""), unknown_in_first


@st.composite
def preferred_answers(draw: st.DrawFn) -> bytes | None:
    if draw(st.integers(0, 3)) == 0:
        return None
    ids = st.lists(st.sampled_from([*sorted(DEVICE_IDS), "ghost", "", "d0"]), max_size=6)
    answer = pb.PreferredAllocationResponse(
        container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=draw(ids)) for _ in range(draw(st.integers(0, 2)))
        ]
    )
    return answer.SerializeToString()


@pytest.fixture(scope="module")
def setup(fuzz_root: Path) -> Iterator[tuple[AgentProcess, TestPlugin, int, PodResourcesClient]]:
    port = free_port()
    agent = AgentProcess(
        fuzz_root / "answers",
        "--debug-admit-api", f"127.0.0.1:{port}",
        "--startup-plugin-wait", "0s",
        "--topology-policy", "best-effort", "--numa-nodes", "2",
        plugin_dir=fuzz_root / "answers" / "dp",
    ).start()  # fmt: skip
    plugin = TestPlugin(agent.plugin_dir, "answers.sock", DEVICES, "--preferred", "--pre-start")
    pod_resources = PodResourcesClient(agent.workdir / "pod-resources" / "kubelet.sock")
    try:
        assert plugin.register(RESOURCE)["ok"]
        wait_for(lambda: agent.counts(RESOURCE) == (4, 4), what="the plugin's devices")
        yield agent, plugin, port, pod_resources
    finally:
        pod_resources.close()
        plugin.stop()
        agent.kill()


def post(port: int, path: str, payload: object) -> dict[str, object]:
    body = json.dumps(payload).encode()
    head = b"POST %s HTTP/1.1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body))
    request = head + body
    [(status, _fields, answer)] = responses(exchange(port, request, []))
    assert status == 200, answer
    return dict(json.loads(answer))


def checkpoint_entries(agent: AgentProcess, uid: str) -> dict[str, tuple[set[str], bytes | None]] | None:
    """{container: (devices, AllocResp)} of the pod in the kubelet-format checkpoint, once it is there."""
    data = decode((agent.plugin_dir / CHECKPOINT).read_bytes())
    found = {e.ContainerName: (e.devices(), e.AllocResp) for e in data.PodDeviceEntries or () if e.PodUID == uid}
    return found or None


def held_devices(agent: AgentProcess) -> int:
    """The resource's devices held by some container (`allocatable` counts the healthy ones, held or not)."""
    resource = agent.resource(RESOURCE)
    assert resource is not None
    return int(resource["allocated"])


counter = iter(range(1_000_000))


@fuzz_settings(bounded=60, long=1_000)
@given(allocate_answers(), preferred_answers(), st.lists(st.integers(1, 2), min_size=1, max_size=2))
def test_whatever_a_plugin_answers_the_pod_settles_cleanly(
    setup: tuple[AgentProcess, TestPlugin, int, PodResourcesClient],
    allocate: tuple[bytes, bool] | None,
    preferred: bytes | None,
    counts: list[int],
) -> None:
    agent, plugin, port, pod_resources = setup
    assert plugin.send(
        cmd="responses",
        allocate=None if allocate is None else allocate[0].hex(),
        preferred=None if preferred is None else preferred.hex(),
    )["ok"]
    name = f"p{next(counter)}"
    uid = f"uid-{name}"
    containers = [{"name": f"c{i}", "resources": {"limits": {RESOURCE: str(n)}}} for i, n in enumerate(counts)]
    pod = {"metadata": {"name": name, "namespace": "fz", "uid": uid}, "spec": {"containers": containers}}

    answer = post(port, "/debug/v1/admit", pod)
    sent = None if allocate is None else pb.AllocateResponse.FromString(allocate[0])
    expect_admitted = sent is None or len(sent.container_responses) > 0
    assert answer["admitted"] is expect_admitted, answer
    event(f"admitted: {expect_admitted}")

    if expect_admitted:
        [shown] = [p for p in agent.get("/api/v1/pods") if p["uid"] == uid]
        held = {c["name"]: set(c["devices"].get(RESOURCE, [])) for c in shown["containers"]}
        assert {c: len(ids) for c, ids in held.items()} == {f"c{i}": n for i, n in enumerate(counts)}, shown
        every = [device for ids in held.values() for device in ids]
        assert len(every) == len(set(every)) and set(every) <= DEVICE_IDS, held
        listed = listed_devices(pod_resources.list())
        assert {c: listed.get(("fz", name, c), {}).get(RESOURCE, set()) for c in held} == held
        entries = wait_for(lambda: checkpoint_entries(agent, uid), what="the pod in the checkpoint")
        assert {c: ids for c, (ids, _) in entries.items()} == held
        for container, (ids, alloc_resp) in entries.items():
            assert alloc_resp is not None
            stored = pb.ContainerAllocateResponse.FromString(alloc_resp)
            if sent is None:  # the plugin's default answer names the devices it was asked for
                assert set(stored.envs["TEST_DEVICES"].split(",")) == ids, (container, stored)
                continue
            assert stored == sent.container_responses[0]  # the first one counts, as upstream
            assert allocate is not None
            if allocate[1]:
                assert alloc_resp.endswith(UNKNOWN_FIELD), alloc_resp  # kept for a newer kubelet to read
        assert post(port, "/debug/v1/remove", {"uid": uid})["removed"] is True
    else:
        assert str(answer["reason"]).startswith("no containers return in allocation response"), answer
        listed = listed_devices(pod_resources.list())
        assert not [key for key in listed if key[1] == name], listed
        assert held_devices(agent) == 0, "the refused pod holds a device"
        post(port, "/debug/v1/remove", {"uid": uid})

    assert held_devices(agent) == 0, "a device is still held"
    assert agent.counts(RESOURCE) == (4, 4), "a device is no longer healthy"
    log = agent.log()
    assert "admission failed unexpectedly" not in log and "Traceback" not in log, log[-3000:]
    assert_live(agent)
