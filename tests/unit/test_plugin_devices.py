from __future__ import annotations

import asyncio
import threading

import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.plugin import Allocation, Device, DeviceListTooLarge, DevicePlugin, DeviceSpec, Mount
from deviceplane.plugin.devices import MAX_BACKLOG, MAX_MESSAGE_BYTES, DeviceSet


def test_device_validation():
    assert Device("a", numa_nodes=[1, 0]).numa_nodes == (1, 0)
    for bad in ({"id": ""}, {"id": "a", "numa_nodes": [-1]}, {"id": "a", "numa_nodes": [True]}):
        with pytest.raises(ValueError):
            Device(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("healthy", ["Unhealthy", "Healthy", 0, 1, None])
def test_health_is_a_bool(healthy):
    """Any truthy value counted: Device(id, healthy="Unhealthy") was streamed to the kubelet as Healthy."""
    with pytest.raises(ValueError, match=rf"device 'a': healthy must be True or False, got {healthy!r}"):
        Device("a", healthy=healthy)


@pytest.mark.parametrize(
    ("allocation", "message"),
    [
        (Allocation(envs={"A": 1}), "envs['A']: int 1, expected str"),  # type: ignore[dict-item]
        (Allocation(annotations={1: "v"}), "annotations[1]: int 1, expected str"),  # type: ignore[dict-item]
        (Allocation(envs=[("A", "1")]), "envs is list, expected a mapping of str to str"),  # type: ignore[arg-type]
        (Allocation(mounts=[Mount("/c", 5)]), "mounts[0].host_path is int 5, expected str"),  # type: ignore[arg-type]
        (Allocation(devices=[Mount("/c", "/h")]), "devices[0] is Mount, expected DeviceSpec"),  # type: ignore[list-item]
        (Allocation(cdi_devices="v.com/c=1"), "cdi_devices is str, expected a list of str"),
    ],
)
def test_allocation_names_the_bad_field(allocation, message):
    """protobuf's own TypeError ("bad argument type for built-in operation") named neither field nor value."""
    with pytest.raises(TypeError) as err:
        allocation.to_proto()
    assert str(err.value) == message


def test_device_proto():
    assert Device("a", healthy=False, numa_nodes=[1]).to_proto() == pb.Device(
        ID="a", health="Unhealthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])
    )
    assert not Device("b").to_proto().HasField("topology")


def test_allocation_proto():
    proto = Allocation(
        envs={"A": "1"},
        mounts=[Mount("/c", "/h", True)],
        devices=[DeviceSpec("/dev/x", "/dev/null")],
        annotations={"k": "v"},
        cdi_devices=["v.com/c=1"],
    ).to_proto()
    assert dict(proto.envs) == {"A": "1"} and dict(proto.annotations) == {"k": "v"}
    assert proto.mounts[0] == pb.Mount(container_path="/c", host_path="/h", read_only=True)
    assert proto.devices[0] == pb.DeviceSpec(container_path="/dev/x", host_path="/dev/null", permissions="rw")
    assert proto.cdi_devices[0].name == "v.com/c=1"


def test_duplicate_ids_rejected_and_state_kept():
    devices = DeviceSet([Device("a")])
    with pytest.raises(ValueError, match="duplicate device id 'b'"):
        devices.replace([Device("b"), Device("b")])
    with pytest.raises(TypeError):
        devices.replace(["a"])  # type: ignore[list-item]
    assert devices.current.devices == (Device("a"),)


def many(count: int, id_length: int = 200) -> list[Device]:
    return [Device(f"{i:06d}".ljust(id_length, "x")) for i in range(count)]


def test_a_list_over_the_kubelets_message_limit_is_refused_and_the_last_one_kept():
    """Streamed, a ListAndWatch message over 4 MiB ended the kubelet's stream (ResourceExhausted, in its log only)
    and the node kept the old devices, unhealthy. Refused here, with the size and the limit."""
    plugin = DevicePlugin("example.com/big", many(10))
    fits = many(20_000, 190)  # 20,000 x 205 bytes: just under 4 MiB
    assert DeviceSet(fits).current.message.ByteSize() <= MAX_MESSAGE_BYTES
    plugin.set_devices(fits)
    too_many = many(20_000, 200)  # x 215: just over
    with pytest.raises(DeviceListTooLarge, match=r"20000 devices make a \d+-byte ListAndWatch message, over the "
                       r"kubelet's limit of 4194304 bytes \(4 MiB"):  # fmt: skip
        plugin.set_devices(too_many)
    assert plugin.devices == tuple(fits)
    with pytest.raises(ValueError, match="over the kubelet's limit"):
        DevicePlugin("example.com/big", too_many)


def test_unchanged_list_is_not_a_new_version():
    devices = DeviceSet([Device("a")])
    assert not devices.replace([Device("a")])
    assert devices.replace([Device("a", healthy=False)])
    assert devices.current.version == 1


async def collect(devices: DeviceSet, into: list[int], ready: asyncio.Event) -> None:
    async for snapshot in devices.watch():
        into.append(snapshot.version)
        ready.set()


async def test_every_watcher_sees_every_version_in_order_even_from_threads():
    devices = DeviceSet()
    devices.attach(asyncio.get_running_loop())
    seen: list[list[int]] = [[], []]
    readies = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(collect(devices, s, r)) for s, r in zip(seen, readies, strict=True)]
    for ready in readies:
        await ready.wait()

    def writer(prefix: str) -> None:
        for i in range(100):
            devices.replace([Device(f"{prefix}{i}")])

    threads = [threading.Thread(target=writer, args=(p,)) for p in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    await asyncio.sleep(0.1)
    devices.close()
    await asyncio.gather(*tasks)
    for versions in seen:
        assert versions == list(range(201))


async def test_stuck_reader_is_coalesced_not_unbounded():
    devices = DeviceSet()
    devices.attach(asyncio.get_running_loop())
    stream = devices.watch()
    assert (await anext(stream)).version == 0
    for i in range(MAX_BACKLOG * 3):
        devices.replace([Device(f"d{i}")])
    await asyncio.sleep(0.05)
    versions = []
    devices.close()
    async for snapshot in stream:
        versions.append(snapshot.version)
    assert versions[-1] == MAX_BACKLOG * 3  # the newest always arrives
    assert len(versions) <= MAX_BACKLOG
