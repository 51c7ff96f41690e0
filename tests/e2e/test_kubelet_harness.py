"""The kubelet's own device manager (real ManagerImpl + topology manager, via our Go harness) as a peer.

The upstream sample-device-plugin is the first peer (it proves the harness); our SDK's `sim` plugin is the second
(it proves the SDK against the real kubelet code).
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import pytest

from tests.support.pods import PodResourcesClient

from .procs import wait_for


def pod(name: str, *, init: dict[str, int] | None = None, app: dict[str, int] | None = None) -> dict[str, Any]:
    def container(cname: str, limits: dict[str, int]) -> dict[str, Any]:
        return {
            "name": cname,
            "image": "registry.invalid/none:1",
            "resources": {"limits": {k: str(v) for k, v in limits.items()}},
        }

    spec: dict[str, Any] = {"containers": [container("app", app or {})]}
    if init:
        spec["initContainers"] = [container("init", init)]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": spec,
    }


def _capacity_is(h, resource: str, n: int):
    def check() -> bool:
        cap = h.capacity()
        return cap["capacity"].get(resource) == n and cap["allocatable"].get(resource) == n

    return check


def test_sample_plugin_registers_with_kubelet_harness_and_allocates(
    kubelet_harness, sample_device_plugin, short_tmp
) -> None:
    h = kubelet_harness(short_tmp("kh"))
    plugin = sample_device_plugin(h.socket_dir)
    wait_for(
        "example.com/resource = 2 in the harness", _capacity_is(h, "example.com/resource", 2), procs=[h.proc, plugin]
    )
    cap = h.capacity()
    assert sorted(d["id"] for d in cap["devices"]["example.com/resource"]) == ["Dev-1", "Dev-2"]

    # Init container takes 1, app container 2: the init container's device is reused (kubelet semantics).
    first = pod("first", init={"example.com/resource": 1}, app={"example.com/resource": 2})
    res = h.admit(first)
    assert res["admitted"], res
    by_name = {c["name"]: c for c in res["containers"]}
    init_ids = by_name["init"]["devices"]["example.com/resource"]
    app_ids = by_name["app"]["devices"]["example.com/resource"]
    assert len(init_ids) == 1 and sorted(app_ids) == ["Dev-1", "Dev-2"]
    assert set(init_ids) <= set(app_ids)
    # The plugin's own Allocate response, through GetDeviceRunContainerOptions: a mount of /tmp/<id> per device.
    mounts = {m["containerPath"]: m["hostPath"] for m in by_name["app"]["runOptions"]["mounts"]}
    assert mounts == {"/tmp/Dev-1": "/tmp/Dev-1", "/tmp/Dev-2": "/tmp/Dev-2"}
    assert not by_name["app"].get("error")

    # Nothing left: the real manager rejects a second pod with its exact error.
    second = pod("second", app={"example.com/resource": 1})
    res2 = h.admit(second)
    assert not res2["admitted"], res2
    assert "requested number of devices unavailable for example.com/resource" in res2["message"], res2

    # The first pod goes away; its devices are freed and the second pod fits.
    assert h.remove(first["metadata"]["uid"])["removed"]
    res3 = h.admit(second)
    assert res3["admitted"], res3
    (app,) = res3["containers"]
    assert len(app["devices"]["example.com/resource"]) == 1

    # A resource no plugin ever registered is not a device-plugin resource: the device manager leaves it alone
    # (the scheduler, not the device manager, would have kept such a pod off the node).
    res4 = h.admit(pod("third", app={"example.com/nonexistent": 1}))
    assert res4["admitted"] is True, res4
    assert res4["containers"][0]["devices"] == {}


def test_sdk_sim_plugin_registers_with_kubelet_harness(kubelet_harness, sim_plugin, short_tmp) -> None:
    h = kubelet_harness(short_tmp("kh"), numa_nodes=2, policy="single-numa-node")
    plugin = sim_plugin(h.socket_dir, resource="example.com/sim", count=4, numa=2)
    wait_for("example.com/sim = 4 in the harness", _capacity_is(h, "example.com/sim", 4), procs=[h.proc, plugin])
    devices = h.capacity()["devices"]["example.com/sim"]
    assert len(devices) == 4
    assert {n for d in devices for n in d["numaNodes"]} == {0, 1}, devices

    # 4 devices over 2 NUMA nodes: a 3-device request cannot be aligned on one node and must be rejected.
    res0 = h.admit(pod("too-wide", app={"example.com/sim": 3}))
    assert not res0["admitted"], res0
    assert res0["reason"] == "TopologyAffinityError", res0

    res = h.admit(pod("sim-user", app={"example.com/sim": 2}))
    assert res["admitted"], res
    (app,) = res["containers"]
    ids = app["devices"]["example.com/sim"]
    assert len(ids) == 2
    numa = {d["id"]: tuple(d["numaNodes"]) for d in devices}
    # single-numa-node policy: both devices from one NUMA node (the real topology manager decided).
    assert len({numa[i] for i in ids}) == 1, (ids, numa)
    assert app["runOptions"] is not None and not app.get("error")

    # The other NUMA node still has 2 free devices: a second 2-device pod fits there.
    res2 = h.admit(pod("sim-user-2", app={"example.com/sim": 2}))
    assert res2["admitted"], res2
    ids2 = res2["containers"][0]["devices"]["example.com/sim"]
    assert not set(ids) & set(ids2)
    assert len({numa[i] for i in ids2}) == 1 and {numa[i] for i in ids2} != {numa[i] for i in ids}


def test_pod_resources_get_of_a_pod_rejected_at_admission(kubelet_harness, sample_device_plugin, short_tmp) -> None:
    """The kubelet's own PodResources Get (v1.36 server_v1.go, through the harness's pods provider, which answers
    GetPodByName as the pod manager does) finds a pod rejected at admission: its containers, no devices. Only an
    unknown pod is `pod <name> in namespace <ns> not found`. The agent answers the same
    (tests/integration/test_podresources.py)."""
    socket = short_tmp("kh-pr") / "pod-resources.sock"
    h = kubelet_harness(short_tmp("kh"), pod_resources_socket=socket)
    plugin = sample_device_plugin(h.socket_dir)
    wait_for("example.com/resource = 2", _capacity_is(h, "example.com/resource", 2), procs=[h.proc, plugin])
    assert h.admit(pod("holder", app={"example.com/resource": 2}))["admitted"]
    assert not h.admit(pod("nope", app={"example.com/resource": 1}))["admitted"]
    client = PodResourcesClient(socket)
    try:
        assert [p.name for p in client.list().pod_resources] == ["holder"]
        got = client.get("default", "nope").pod_resources
        assert (got.namespace, got.name, [c.name for c in got.containers]) == ("default", "nope", ["app"])
        assert not got.containers[0].devices
        with pytest.raises(grpc.RpcError) as err:
            client.get("default", "unknown")
        assert err.value.details() == "pod unknown in namespace default not found"
    finally:
        client.close()
