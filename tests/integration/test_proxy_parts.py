"""Proxy mode's pieces on their own: the kubelet-facing feed, the PodResources join, the plugin record (fuzzed),
endpoint naming and socket identity, and which of a plugin's error trailers are forwarded. Real files, sockets and
asyncio (gRPC servers in process for the connector); no processes."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import tracemalloc
from pathlib import Path

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.agent.proxy.feed import SnapshotFeed, all_unhealthy
from deviceplane.agent.proxy.forwarder import DEADLINE_MARGIN_SECONDS, plugin_deadline
from deviceplane.agent.proxy.ownership import Ownership, kubelet_view
from deviceplane.agent.proxy.recovery import PluginRecord, reconnect, remove_stale_sockets
from deviceplane.agent.proxy.service import ProxyConnector
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.lean_grpc.status import trailing_metadata
from deviceplane.unix_sockets import MAX_SOCKET_PATH, socket_identity
from tests.support.plugins import short_tmpdir


def message(*devices: tuple[str, str]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health=h) for i, h in devices])


# ---- feed --------------------------------------------------------------------------------------------------------


async def test_feed_streams_primary_then_all_unhealthy_then_the_new_plugin() -> None:
    feed = SnapshotFeed()
    seen: list[pb.ListAndWatchResponse] = []

    async def follow() -> None:
        async for wire in feed.follow():
            seen.append(pb.ListAndWatchResponse.FromString(wire))

    reader = asyncio.create_task(follow())
    first = message(("a", "Healthy"), ("b", "Healthy"))
    assert feed.show(first, connected=True)
    await asyncio.sleep(0.01)
    assert not feed.show(first, connected=True)  # unchanged: nothing sent
    assert feed.show(None, connected=False)  # plugin gone: same devices, all unhealthy
    await asyncio.sleep(0.01)
    assert not feed.show(None, connected=True)  # a new plugin before its first message: keep what we show
    second = message(("a", "Healthy"), ("b", "Unhealthy"))
    assert feed.show(second, connected=True)
    await asyncio.sleep(0.01)
    feed.close()
    await asyncio.wait_for(reader, 1)
    assert seen == [first, message(("a", "Unhealthy"), ("b", "Unhealthy")), second]


async def test_feed_end_streams_ends_the_streams_following_and_no_later_one() -> None:
    feed = SnapshotFeed()
    feed.show(message(("a", "Healthy")), connected=True)

    async def received(count: int) -> list[bytes]:
        got = []
        async for wire in feed.follow():
            got.append(wire)
            if len(got) == count:
                break
        return got

    old = asyncio.create_task(received(2))
    await asyncio.sleep(0.01)
    feed.end_streams()
    assert len(await asyncio.wait_for(old, 1)) == 1  # ended after the one snapshot it had
    later = asyncio.create_task(received(2))
    await asyncio.sleep(0.01)
    feed.show(message(("a", "Unhealthy")), connected=True)
    assert len(await asyncio.wait_for(later, 1)) == 2  # a stream started after it follows as usual
    feed.close()


async def test_feed_gives_a_slow_reader_only_the_newest_snapshot() -> None:
    feed = SnapshotFeed()
    for n in range(5):
        feed.show(message((f"d{n}", "Healthy")), connected=True)
    stream = feed.follow()
    assert pb.ListAndWatchResponse.FromString(await anext(stream)) == message(("d4", "Healthy"))
    feed.close()
    assert [w async for w in stream] == []


async def test_feed_without_any_message_sends_nothing_on_disconnect() -> None:
    feed = SnapshotFeed()
    assert not feed.show(None, connected=False)
    assert feed.current is None


# ---- PodResources join -------------------------------------------------------------------------------------------


def test_kubelet_view_names_each_devices_pod_once_per_device() -> None:
    listed = pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="trainer",
                namespace="ml",
                containers=[
                    pr.ContainerResources(
                        name="main",
                        devices=[
                            # the kubelet sends one entry per device per NUMA node
                            pr.ContainerDevices(
                                resource_name="x.io/gpu",
                                device_ids=["g0"],
                                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=0)]),
                            ),
                            pr.ContainerDevices(
                                resource_name="x.io/gpu",
                                device_ids=["g0"],
                                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=1)]),
                            ),
                            pr.ContainerDevices(resource_name="x.io/gpu", device_ids=["g1"]),
                        ],
                    )
                ],
            )
        ]
    )
    allocatable = pr.AllocatableResourcesResponse(
        devices=[pr.ContainerDevices(resource_name="x.io/gpu", device_ids=[i]) for i in ("g0", "g1", "g2")]
    )
    view = kubelet_view(listed, allocatable)
    assert {k: v.model_dump() for k, v in view.holders.items()} == {
        ("x.io/gpu", "g0"): {"namespace": "ml", "pod": "trainer", "container": "main"},
        ("x.io/gpu", "g1"): {"namespace": "ml", "pod": "trainer", "container": "main"},
    }
    assert view.pods[0]["containers"] == [{"name": "main", "devices": {"x.io/gpu": ["g0", "g1"]}}]
    assert view.allocatable == {"x.io/gpu": {"g0", "g1", "g2"}}


def test_a_forwarded_allocate_is_pending_until_podresources_lists_it() -> None:
    now = [100.0]
    ownership = Ownership(Path("/nonexistent"), clock=lambda: now[0])
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["g1"])])
    ownership.allocated("x.io/gpu", request.SerializeToString())
    (pending,) = ownership.pods_json()
    assert pending["source"] == "allocate" and pending["containers"][0]["devices"] == {"x.io/gpu": ["g1"]}
    now[0] += 3600  # never claimed by a pod (a failed admission): forgotten
    assert ownership.pods_json() == []


# ---- the plugin record (read at start: hostile content must not matter) ---------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=300)
    | st.recursive(st.none() | st.text() | st.integers(), st.lists, max_leaves=10).map(lambda v: json.dumps(v).encode())
)
def test_plugin_record_load_never_raises(content: bytes) -> None:
    with short_tmpdir() as tmp:
        (tmp / "deviceplane_proxy_plugins.json").write_bytes(content)
        loaded = PluginRecord(tmp).load()
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items())


def test_plugin_record_round_trip_and_dead_plugins_are_dropped() -> None:
    with short_tmpdir() as tmp:
        record = PluginRecord(tmp)
        record.save({"x.io/b": str(tmp / "b.sock"), "x.io/a": str(tmp / "a.sock")})
        assert PluginRecord(tmp).load() == {"x.io/a": str(tmp / "a.sock"), "x.io/b": str(tmp / "b.sock")}
        # Nothing serves those sockets (not even files): reconnect skips them and calls nothing.
        calls: list[tuple[str, str]] = []

        async def register(resource: str, socket_path: str) -> None:
            calls.append((resource, socket_path))

        assert asyncio.run(reconnect(record.load(), register)) == []
        assert calls == []


def test_stale_sockets_removed_except_the_recorded_ones() -> None:
    import socket

    with short_tmpdir() as tmp:
        made = []
        for name in ("kubelet.sock", "keep.sock", "old.sock"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(tmp / name))
            made.append(s)
        (tmp / "kubelet_internal_checkpoint").write_text("{}")
        removed = remove_stale_sockets(tmp, keep={str(tmp / "keep.sock")})
        for s in made:
            s.close()
        assert sorted(removed) == ["kubelet.sock", "old.sock"]
        assert sorted(p.name for p in tmp.iterdir()) == ["keep.sock", "kubelet_internal_checkpoint"]


# ---- endpoint names ----------------------------------------------------------------------------------------------


@given(
    st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,60}[a-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?", fullmatch=True)
)
def test_endpoint_names_fit_a_socket_address_and_stay_in_the_directory(resource: str) -> None:
    directory = Path("/var/lib/kubelet/device-plugins")
    name = endpoint_name(resource, directory)
    assert "/" not in name and name.startswith("deviceplane-proxy-") and name.endswith(".sock")
    assert len(str(directory / name).encode()) <= MAX_SOCKET_PATH
    assert endpoint_name(resource, directory) == name  # stable across restarts


def test_all_unhealthy_keeps_ids_and_topology_as_they_were() -> None:
    original = pb.ListAndWatchResponse(
        devices=[
            pb.Device(ID="n", health="Healthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])),
            pb.Device(ID="t", health="Healthy"),  # no topology: the kubelet books it under no NUMA node
        ]
    )
    dimmed = all_unhealthy(original)
    assert [(d.ID, d.health) for d in dimmed.devices] == [("n", "Unhealthy"), ("t", "Unhealthy")]
    assert dimmed.devices[0].topology == original.devices[0].topology
    assert not dimmed.devices[1].HasField("topology")
    assert original.devices[0].health == "Healthy"  # the plugin's message is not touched


def test_socket_identity_survives_metadata_changes_not_replacement() -> None:
    with short_tmpdir() as tmp:
        path = tmp / "proxy.sock"
        first = socket.socket(socket.AF_UNIX)
        second = socket.socket(socket.AF_UNIX)
        try:
            first.bind(str(path))
            identity = socket_identity(path)
            os.chmod(path, 0o600)  # changes the ctime only
            assert socket_identity(path) == identity
            path.unlink()
            keep = tmp / "keep"  # holds the old inode, so the new socket cannot reuse its number
            keep.touch()
            second.bind(str(path))
            assert socket_identity(path) not in (None, identity)
        finally:
            first.close()
            second.close()


def test_trailing_metadata_keeps_what_grpc_would_send_on() -> None:
    details = b"\x08\x09\x12\x04boom"
    trailers = (
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "9"),
        ("grpc-message", "boom"),
        ("grpc-status-details-bin", "CAkSBGJvb20"),  # base64 of `details`, unpadded (as grpc sends it)
        ("x-reason", "no capacity"),
        ("x-latin", "caf\xe9"),  # not ASCII: grpc would refuse to send it
        ("x-broken-bin", "not base64!"),
        ("X-Upper", "bad name"),
    )
    assert trailing_metadata(trailers) == (("grpc-status-details-bin", details), ("x-reason", "no capacity"))


# ---- the connector -----------------------------------------------------------------------------------------------


def _options_server(socket_path: Path) -> grpc.aio.Server:
    """A plugin's DevicePlugin service as far as a connection needs it (GetDevicePluginOptions), on a real socket."""

    async def options(_request: bytes, _context: object) -> bytes:
        return pb.DevicePluginOptions().SerializeToString()

    handler = grpc.method_handlers_generic_handler(
        "v1beta1.DevicePlugin", {"GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(options)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{socket_path}")
    return server


async def test_connector_forgets_the_sockets_of_plugins_that_restarted_under_new_names() -> None:
    """A plugin that restarts under a new socket name each time (a name with its pid or a timestamp) is a new
    (resource, socket) for the connector: each of its connections is made, connected and, when the next one replaces
    it, closed, as the device manager does. What the connector keeps must not grow with the restarts."""
    connector = ProxyConnector()
    restarts = 150
    with short_tmpdir() as tmp:
        tracemalloc.start()
        try:
            before = 0
            for n in range(restarts):
                socket_path = tmp / f"sim-{n}.sock"
                server = _options_server(socket_path)
                await server.start()
                client = connector("example.com/sim", str(socket_path))
                await client.connect(5.0)
                await client.close()
                await server.stop(grace=None)
                del client
                gc.collect()
                if n == 20:
                    before = tracemalloc.get_traced_memory()[0]
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    kept = sum(len(refs) for refs in connector._made.values())
    print(f"{restarts} restarts: {len(connector._made)} sockets, {kept} connections kept, {grown} bytes grown")
    assert len(connector._made) <= 1
    assert connector.current("example.com/sim", str(tmp / f"sim-{restarts - 1}.sock")) is None


# ---- deadlines ---------------------------------------------------------------------------------------------------


def test_the_plugin_is_told_a_deadline_before_ours_and_ours_is_before_the_kubelets() -> None:
    assert plugin_deadline(None) == (None, None)  # Allocate, GetPreferredAllocation: no deadline anywhere
    ours, told = plugin_deadline(30.0)  # PreStartContainer
    assert (ours, told) == (30.0 - DEADLINE_MARGIN_SECONDS, 30.0 - 2 * DEADLINE_MARGIN_SECONDS)
    for remaining in (0.0, 0.01, 0.4, 1.0, 5.0):  # little left: the margins shrink, the order stays
        ours, told = plugin_deadline(remaining)
        assert ours is not None and told is not None and 0.0 <= told <= ours <= remaining
        assert told >= remaining / 2
