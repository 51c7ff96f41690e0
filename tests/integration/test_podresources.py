"""The PodResources API v1 on the agent's socket, answering as the kubelet does (spec §2, §4.13, §6.3)."""

from __future__ import annotations

import grpc
import pytest

from deviceplane.api.podresources.v1 import api_pb2 as pr
from tests.support.alloc_env import AllocEnv
from tests.support.pods import container, listed_devices, pod_manifest, pods, wait_settled, write_pod
from tests.support.procs import TestPlugin, wait_for

RES = "example.com/topo"
SIM = "example.com/sim"


def rows(devices: list[pr.ContainerDevices]) -> list[tuple[str, tuple[str, ...], tuple[int, ...] | None]]:
    return sorted(
        (
            d.resource_name,
            tuple(d.device_ids),
            tuple(n.ID for n in d.topology.nodes) if d.HasField("topology") else None,
        )
        for d in devices
    )


def test_one_entry_per_device_per_numa_node(env: AllocEnv) -> None:
    """§6.3 TestGetContainerDevices and §2: dev1 on NUMA 0 and 1 gives two entries; a device without topology one
    entry with no topology; unhealthy devices are not allocatable but allocated ones still are."""
    plugin = TestPlugin(env.plugin_dir, "topo.sock",
                        [["dev1", "Healthy", [0, 1]], ["dev2", "Healthy"], ["dev3", "Unhealthy", [1]]])  # fmt: skip
    try:
        assert plugin.register(RES)["ok"]
        env.wait_devices(RES, 2)
        write_pod(env.pod_dir, "p.json", pod_manifest("p", [container("c", {RES: 2})], namespace="ns1"))
        assert wait_settled(env.agent, "p")["admitted"]
        client = env.pod_resources()
        listed = client.list()
        assert [(p.namespace, p.name) for p in listed.pod_resources] == [("ns1", "p")]
        (ctr,) = listed.pod_resources[0].containers
        assert ctr.name == "c" and not ctr.cpu_ids and not ctr.memory and not ctr.dynamic_resources
        assert rows(list(ctr.devices)) == [(RES, ("dev1",), (0,)), (RES, ("dev1",), (1,)), (RES, ("dev2",), None)]
        got = client.get("ns1", "p").pod_resources
        assert got == listed.pod_resources[0]
        allocatable = client.allocatable()
        assert rows(list(allocatable.devices)) == [
            (RES, ("dev1",), (0,)),
            (RES, ("dev1",), (1,)),
            (RES, ("dev2",), None),
        ]
        assert not allocatable.cpu_ids and not allocatable.memory
    finally:
        plugin.stop()


def test_failed_pods_are_not_listed_but_get_finds_them_and_only_unknown_pods_are_not_found(env: AllocEnv) -> None:
    """List shows active pods only. Get answers as the v1.36 kubelet (server_v1.go Get: podsProvider.GetPodByName,
    the pod manager, which keeps a pod rejected at admission until it is deleted): the rejected pod with its
    containers and no devices. Only a pod no source reports is `pod <name> in namespace <ns> not found`."""
    env.sim(SIM, 1)
    write_pod(env.pod_dir, "ok.json", pod_manifest("ok", [container("c", {SIM: 1})]))
    assert wait_settled(env.agent, "ok")["admitted"]
    write_pod(env.pod_dir, "nope.json", pod_manifest("nope", [container("c", {SIM: 1})]))
    assert not wait_settled(env.agent, "nope")["admitted"]  # no free device: rejected, still a pod of the node
    client = env.pod_resources()
    assert [p.name for p in client.list().pod_resources] == ["ok"]
    got = client.get("default", "nope").pod_resources
    assert (got.namespace, got.name, [c.name for c in got.containers]) == ("default", "nope", ["c"])
    assert not got.containers[0].devices
    with pytest.raises(grpc.RpcError) as err:
        client.get("elsewhere", "ok")
    assert err.value.details() == "pod ok in namespace elsewhere not found"  # type: ignore[attr-defined]


def test_lists_sidecars_and_app_containers_not_finished_init(env: AllocEnv) -> None:
    env.sim(SIM, 4)
    manifest = pod_manifest(
        "p",
        [container("app", {SIM: 1})],
        init=[container("setup", {SIM: 2}), container("side", {SIM: 1}, restart_policy="Always")],
    )
    write_pod(env.pod_dir, "p.json", manifest)
    view = wait_settled(env.agent, "p")
    assert view["admitted"]
    listed = listed_devices(env.pod_resources().list())
    assert set(listed) == {("default", "p", "side"), ("default", "p", "app")}
    by_name = {c["name"]: set(c["devices"].get(SIM, [])) for c in view["containers"]}
    assert listed[("default", "p", "side")][SIM] == by_name["side"]
    assert listed[("default", "p", "app")][SIM] == by_name["app"]


def test_list_agrees_with_pods_view_and_allocatable_follows_health(env: AllocEnv) -> None:
    sim = env.sim(SIM, 6, 2)
    for i in range(4):
        write_pod(env.pod_dir, f"p{i}.json", pod_manifest(f"p{i}", [container("a", {SIM: 1}), container("b")]))
    for i in range(4):
        assert wait_settled(env.agent, f"p{i}")["admitted"]
    client = env.pod_resources()
    listed = listed_devices(client.list())
    view = {
        ("default", p["name"], c["name"]): {r: set(ids) for r, ids in c["devices"].items()}
        for p in pods(env.agent).values()
        if p["admitted"]
        for c in p["containers"]
    }
    assert listed == view
    sim.control("POST", "/devices/sim-5/unhealthy")
    wait_for(lambda: len(client.allocatable().devices) == 5, what="unhealthy device leaves allocatable")
    assert "sim-5" not in {d.device_ids[0] for d in client.allocatable().devices}
