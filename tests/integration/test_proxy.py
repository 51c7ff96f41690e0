"""Proxy mode with real processes: sim plugin -> agent (--mode proxy) -> a device manager in the kubelet's place.

The device manager downstream is our own agent in its normal mode (it speaks the kubelet's Registration, DevicePlugin
client and PodResources APIs, and admits static pods); the e2e tests put the kubelet's real device manager there.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import PIPE, STDOUT
from typing import Any

import grpc
import pytest

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.integration.test_agent_metrics import promtool
from tests.support.plugins import PluginProcess, short_tmpdir, wait_until
from tests.support.pods import container, pod_manifest, write_pod
from tests.support.procs import AgentProcess

SIM = "example.com/sim"


class ProxyEnv:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.kubelet_dir = tmp / "k"
        self.plugin_dir = tmp / "p"
        self.pods_dir = tmp / "pods"
        self.pods_dir.mkdir()
        self.kubelet: AgentProcess | None = None
        self.proxy: AgentProcess | None = None
        self.plugins: list[PluginProcess] = []
        self._kubelet_work = tmp / "kw"

    async def start_kubelet(self) -> AgentProcess:
        """The downstream device manager, on the kubelet's dir; it admits static pods from pods_dir."""
        self.kubelet = AgentProcess(
            self._kubelet_work, "--pod-manifest-dir", str(self.pods_dir), plugin_dir=self.kubelet_dir
        ).start(wait=False)
        await wait_until(self.kubelet.healthy, within=30, what="downstream device manager up")
        return self.kubelet

    @property
    def kubelet_pod_resources(self) -> Path:
        return self._kubelet_work / "pod-resources" / "kubelet.sock"

    async def start_proxy(self) -> AgentProcess:
        self.proxy = AgentProcess(
            self.tmp / "pw",
            "--mode", "proxy",
            "--kubelet-dir", str(self.kubelet_dir),
            "--kubelet-pod-resources-socket", str(self.kubelet_pod_resources),
            plugin_dir=self.plugin_dir,
        ).start(wait=False)  # fmt: skip
        await wait_until(self.proxy.healthy, within=30, what="proxy agent up")
        return self.proxy

    def sim(self, *args: str) -> PluginProcess:
        plugin = PluginProcess(self.tmp, "sim", "--plugin-dir", str(self.plugin_dir), "--control", "127.0.0.1:0", *args)
        self.plugins.append(plugin)
        return plugin

    def close(self) -> None:
        for plugin in self.plugins:
            plugin.kill()
        for agent in (self.proxy, self.kubelet):
            if agent is not None:
                agent.stop(signal.SIGKILL)


@pytest.fixture
async def env() -> AsyncIterator[ProxyEnv]:
    with short_tmpdir() as tmp:
        env = ProxyEnv(tmp)
        try:
            yield env
        finally:
            env.close()


async def proxied(env: ProxyEnv, *sim_args: str) -> PluginProcess:
    await env.start_kubelet()
    await env.start_proxy()
    sim = env.sim("--count", "4", "--numa", "2", *sim_args)
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 4), within=20, what="sim via the proxy")
    return sim


async def raw_call(socket: Path, method: str, request: bytes) -> tuple[str, bytes | str]:
    """One DevicePlugin RPC as wire bytes: ("OK", response) or (status code name, details)."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(f"/v1beta1.DevicePlugin/{method}")
        try:
            return "OK", bytes(await call(request, timeout=10))
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details() or ""


async def test_rpcs_forwarded_byte_for_byte_with_the_plugins_status(env: ProxyEnv) -> None:
    sim = await proxied(env)
    direct = Path(sim.control("GET", "/devices")["socket"])
    via_proxy = env.kubelet_dir / endpoint_name(SIM, env.kubelet_dir)
    requests: list[tuple[str, bytes]] = [
        ("GetDevicePluginOptions", pb.Empty().SerializeToString()),
        (
            "Allocate",
            pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=["sim-0", "sim-1"]),
                    pb.ContainerAllocateRequest(devices_ids=["sim-3"]),
                ]
            ).SerializeToString(),
        ),
        (
            "Allocate",
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=["nope"])]
            ).SerializeToString(),
        ),
        (
            "GetPreferredAllocation",
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["sim-0", "sim-1", "sim-2", "sim-3"],
                        must_include_deviceIDs=["sim-2"],
                        allocation_size=2,
                    )
                ]
            ).SerializeToString(),
        ),
        ("PreStartContainer", pb.PreStartContainerRequest(devices_ids=["sim-0"]).SerializeToString()),
    ]
    for method, request in requests:
        want = await raw_call(direct, method, request)
        got = await raw_call(via_proxy, method, request)
        assert got == want, (method, got, want)
    # The success cases did succeed (a test comparing two identical errors would prove little).
    assert (await raw_call(via_proxy, "Allocate", requests[1][1]))[0] == "OK"

    # An injected failure: the kubelet gets the plugin's own status code and details.
    sim.control("PUT", "/faults/Allocate", {"mode": "fail", "message": "device on fire"})
    want = await raw_call(direct, "Allocate", requests[1][1])
    got = await raw_call(via_proxy, "Allocate", requests[1][1])
    assert want[0] != "OK" and got == want, (got, want)

    # The plugin saw every forwarded request; the proxy counted each Allocate with the agent's result labels.
    calls = sim.control("GET", "/calls")
    assert calls["counts"]["Allocate"] >= 6
    assert env.proxy is not None
    assert env.proxy.metric("deviceplane_allocations_total", resource_name=SIM, result="success") == 2.0
    assert env.proxy.metric("deviceplane_allocations_total", resource_name=SIM, result="rpc_error") == 2.0


async def test_health_flip_reaches_kubelet_and_view_within_1s_and_owner_is_named(env: ProxyEnv) -> None:
    sim = await proxied(env)
    assert env.proxy is not None and env.kubelet is not None
    # The downstream manager admits a pod; the proxy learns its owner from that manager's PodResources.
    write_pod(env.pods_dir, "holder.json", pod_manifest("holder", [container("main", {SIM: 1})], namespace="team"))
    held = await wait_until(lambda: _held(env.kubelet), within=15, what="pod admitted downstream")
    (device_id,) = held

    def owner() -> Any:
        resource = env.proxy.resource(SIM) if env.proxy else None
        devices = {d["id"]: d for d in resource["devices"]} if resource else {}
        return devices.get(device_id, {}).get("allocatedTo")

    assert await wait_until(owner, within=5, what="owner in the proxy's view") == {
        "namespace": "team",
        "pod": "holder",
        "container": "main",
    }
    assert env.proxy.metric("deviceplane_devices", resource_name=SIM, state="allocated") == 1.0

    start = time.monotonic()
    sim.control("POST", f"/devices/{device_id}/unhealthy")
    await wait_until(
        lambda: env.kubelet and env.kubelet.devices(SIM)[device_id][0] == "Unhealthy", within=1, what="kubelet side"
    )
    await wait_until(
        lambda: (
            env.proxy and env.proxy.metric("deviceplane_device_health", resource_name=SIM, device_id=device_id) == 0.0
        ),
        within=1,
        what="proxy metric",
    )
    assert time.monotonic() - start < 1.0
    resource = env.proxy.resource(SIM)
    assert resource is not None
    flipped = next(d for d in resource["devices"] if d["id"] == device_id)
    assert flipped["health"] == "Unhealthy" and flipped["allocatedTo"]["pod"] == "holder"
    assert env.kubelet.counts(SIM) == (4, 3)


def _held(agent: AgentProcess | None) -> list[str] | None:
    if agent is None:
        return None
    for pod in agent.get("/api/v1/pods"):
        if pod["name"] == "holder" and pod["admitted"]:
            return list(pod["containers"][0]["devices"].get(SIM, [])) or None
    return None


async def test_plugin_restart_keeps_the_kubelets_stream(env: ProxyEnv) -> None:
    sim = await proxied(env)
    assert env.kubelet is not None
    before = env.kubelet.resource(SIM)
    assert before is not None
    sim.kill()
    # Plugin gone: the kubelet keeps the endpoint (stream open) with every device unhealthy.
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 0), within=2, what="devices unhealthy")
    assert env.kubelet.resource(SIM)["plugin"]["connected"] is True
    env.sim("--count", "4", "--numa", "2")
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 4), within=10, what="plugin back")
    after = env.kubelet.resource(SIM)
    assert after is not None
    # Not re-registered: the same proxy endpoint, registered once, never disconnected.
    assert after["plugin"]["registeredAt"] == before["plugin"]["registeredAt"]
    assert after["plugin"]["endpoint"] == before["plugin"]["endpoint"]
    assert env.kubelet.metric("deviceplane_device_plugin_registration_total", resource_name=SIM) == 1.0


async def test_kubelet_restart_reregisters_within_1s(env: ProxyEnv) -> None:
    await proxied(env)
    assert env.kubelet is not None
    env.kubelet.stop()
    kubelet = await env.start_kubelet()  # cleans its dir (our proxy socket too) and serves a new kubelet.sock
    up = time.monotonic()
    await wait_until(lambda: kubelet.counts(SIM) == (4, 4), within=1, what="re-registered")
    assert time.monotonic() - up < 1.0


async def test_agent_kill9_and_restart(env: ProxyEnv) -> None:
    sim = await proxied(env)
    assert env.kubelet is not None and env.proxy is not None
    write_pod(env.pods_dir, "holder.json", pod_manifest("holder", [container("main", {SIM: 2})]))
    held = await wait_until(lambda: _held(env.kubelet), within=15, what="pod admitted downstream")
    env.proxy.stop(signal.SIGKILL)
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 0), within=5, what="kubelet sees it go")
    killed = time.monotonic()
    proxy = await env.start_proxy()
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 4), within=5, what="re-proxied")
    await wait_until(lambda: _owner_pods(proxy) == {"holder"}, within=5, what="owner visible again")
    assert time.monotonic() - killed < 10  # agent start (Python imports) + 5 s
    # What the kubelet allocated is unchanged, and nothing was allocated twice.
    assert _held(env.kubelet) == held
    assert sim.proc.poll() is None
    # A new pod gets the two other devices.
    write_pod(env.pods_dir, "second.json", pod_manifest("second", [container("main", {SIM: 2})]))

    def second() -> list[str] | None:
        for pod in env.kubelet.get("/api/v1/pods") if env.kubelet else []:
            if pod["name"] == "second" and pod["admitted"]:
                return list(pod["containers"][0]["devices"][SIM])
        return None

    assert not set(await wait_until(second, within=15, what="second pod")) & set(held)


def _owner_pods(agent: AgentProcess) -> set[str]:
    resource = agent.resource(SIM)
    return {d["allocatedTo"]["pod"] for d in resource["devices"] if d["allocatedTo"]} if resource else set()


async def test_proxy_never_allocates_and_serves_no_admission(env: ProxyEnv) -> None:
    await proxied(env)
    assert env.proxy is not None
    # Nothing allocated by the proxy itself; its pods view is the kubelet's (empty: no pods yet).
    assert env.proxy.get("/api/v1/pods") == []
    # Exported at 0 from the plugin's registration, and never counted.
    assert env.proxy.metric("deviceplane_allocations_total", resource_name=SIM, result="success") == 0.0


async def test_proxy_metrics_count_the_kubelets_allocations_and_pass_promtool(env: ProxyEnv) -> None:
    tool = promtool()
    await proxied(env)
    assert env.proxy is not None
    write_pod(env.pods_dir, "holder.json", pod_manifest("holder", [container("main", {SIM: 2})]))
    await wait_until(lambda: _held(env.kubelet), within=15, what="pod admitted downstream")
    # The downstream manager's Allocate went through the proxy: counted with the kubelet's metric semantics.
    await wait_until(
        lambda: env.proxy and env.proxy.metric("deviceplane_allocations_total", resource_name=SIM, result="success"),
        within=5,
        what="allocation counted",
    )
    assert env.proxy.metric("deviceplane_device_plugin_alloc_duration_seconds_count", resource_name=SIM) == 1.0
    await wait_until(
        lambda: env.proxy and env.proxy.metric("deviceplane_devices", resource_name=SIM, state="allocated") == 2.0,
        within=5,
        what="allocated from PodResources",
    )
    check = await asyncio.create_subprocess_exec(tool, "check", "metrics", stdin=PIPE, stdout=PIPE, stderr=STDOUT)
    out, _ = await asyncio.wait_for(check.communicate(env.proxy.get_text("/metrics").encode()), 30)
    assert check.returncode == 0, out.decode()


async def test_two_plugins_for_one_resource_the_kubelet_follows_the_primary(env: ProxyEnv) -> None:
    first = await proxied(env)  # 4 devices
    assert env.kubelet is not None
    registered = env.kubelet.resource(SIM)
    assert registered is not None
    second = env.sim("--count", "2", "--numa", "1")  # newer: becomes primary, its devices are shown
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (2, 2), within=10, what="second plugin shown")
    second.kill()  # the survivor is promoted: its own last snapshot reaches the kubelet at once
    await wait_until(lambda: env.kubelet and env.kubelet.counts(SIM) == (4, 4), within=2, what="survivor shown")
    after = env.kubelet.resource(SIM)
    assert after is not None and after["plugin"]["registeredAt"] == registered["plugin"]["registeredAt"]
    assert first.proc.poll() is None
