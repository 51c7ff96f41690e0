"""Proxy mode across restarts and faults of its neighbours: the agent is a real process (`--mode proxy`) on real unix
sockets; the plugin and the kubelet are in-process fakes built on grpc.aio servers.

Fakes, not the sim plugin and a downstream agent, because these tests need what a real peer does not do on demand:
a plugin whose Allocate takes as long as the test says, that aborts with the trailers the test gives, that answers
GetDevicePluginOptions once and then hangs, or that serves another resource on a recorded socket; and a kubelet
whose every Register (and the options it asked for) the test can read. The fake kubelet does what the real one's
Register does that matters here: it asks the endpoint's options once per registration (spec §4.2), and keeps them.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplane.agent.proxy.endpoint import endpoint_name
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from tests.support.plugins import short_tmpdir, wait_until
from tests.support.procs import AgentProcess

RESOURCE = "example.com/fake"
OTHER = "example.com/other"
ALLOCATE_D0 = pb.AllocateRequest(
    container_requests=[pb.ContainerAllocateRequest(devices_ids=["d0"])]
).SerializeToString()


class FakePlugin(pb_grpc.DevicePluginServicer):
    """A device plugin whose answers the test sets: options, devices, Allocate's delay or abort."""

    def __init__(self, plugin_dir: Path, name: str, pre_start: bool = False, preferred: bool = False) -> None:
        self.socket = plugin_dir / name
        self.pre_start = pre_start
        self.preferred = preferred
        self.devices = [pb.Device(ID=f"d{i}", health="Healthy") for i in range(2)]
        self.allocate_delay = 0.0
        self.allocate_abort: tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]] | None = None
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakePlugin:
        self.server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()
        return self

    async def register(self, agent_socket: Path, resource: str = RESOURCE) -> None:
        async with grpc.aio.insecure_channel(f"unix://{agent_socket}") as channel:
            request = pb.RegisterRequest(version="v1beta1", endpoint=self.socket.name, resource_name=resource)
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=15)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
            self.server = None

    async def GetDevicePluginOptions(self, request, context):  # type: ignore[no-untyped-def]
        return pb.DevicePluginOptions(
            pre_start_required=self.pre_start, get_preferred_allocation_available=self.preferred
        )

    async def ListAndWatch(self, request, context):  # type: ignore[no-untyped-def]
        yield pb.ListAndWatchResponse(devices=self.devices)
        await asyncio.Event().wait()

    async def Allocate(self, request, context):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.allocate_delay)
        if self.allocate_abort is not None:
            code, message, trailing = self.allocate_abort
            context.set_trailing_metadata(trailing)
            await context.abort(code, message)
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(envs={"D": ",".join(r.devices_ids)}) for r in request.container_requests
            ]
        )


class HangingOptionsPlugin(FakePlugin):
    """Answers GetDevicePluginOptions once (the agent's own connect), then never again (the kubelet's question)."""

    answered = 0

    async def GetDevicePluginOptions(self, request, context):  # type: ignore[no-untyped-def]
        self.answered += 1
        if self.answered > 1:
            await asyncio.Event().wait()
        return pb.DevicePluginOptions()


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's Registration on <dir>/kubelet.sock. Each Register asks the endpoint's options once, without a
    deadline (as the kubelet's PluginConnected), and keeps them; every completed registration is recorded."""

    def __init__(self, kubelet_dir: Path) -> None:
        self.dir = kubelet_dir
        self.registrations: list[pb.RegisterRequest] = []
        self.options: dict[str, pb.DevicePluginOptions] = {}
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakeKubelet:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.dir / 'kubelet.sock'}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    async def Register(self, request, context):  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(f"unix://{self.dir / request.endpoint}") as channel:
            options = await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty())
        self.options[request.resource_name] = options
        self.registrations.append(request)  # once done: then `options` has what this registration asked
        return pb.Empty()


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.kubelet_dir = tmp / "k"
        self.plugin_dir = tmp / "p"
        self.kubelet_dir.mkdir()
        self.agent: AgentProcess | None = None
        self.plugins: list[FakePlugin] = []
        self.kubelet: FakeKubelet | None = None

    async def start_kubelet(self) -> FakeKubelet:
        self.kubelet = await FakeKubelet(self.kubelet_dir).start()
        return self.kubelet

    async def start_agent(self, *extra: str) -> AgentProcess:
        self.agent = AgentProcess(
            self.tmp / "w",
            "--mode", "proxy",
            "--kubelet-dir", str(self.kubelet_dir),
            "--kubelet-pod-resources-socket", str(self.tmp / "nonexistent.sock"),
            *extra,
            plugin_dir=self.plugin_dir,
        ).start(wait=False)  # fmt: skip
        await wait_until(self.agent.healthy, within=30, what="agent up")
        return self.agent

    def endpoint(self, resource: str = RESOURCE) -> Path:
        return self.kubelet_dir / endpoint_name(resource, self.kubelet_dir)

    async def plugin(
        self, name: str = "fake.sock", resource: str = RESOURCE, kind: type[FakePlugin] = FakePlugin, **kw: Any
    ) -> FakePlugin:
        """A started plugin, registered with the agent."""
        plugin = await kind(self.plugin_dir, name, **kw).start()
        self.plugins.append(plugin)
        await plugin.register(self.plugin_dir / "kubelet.sock", resource)
        return plugin

    async def close(self) -> None:
        for plugin in self.plugins:
            await plugin.stop()
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self.agent is not None:
            self.agent.stop(signal.SIGKILL)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    with short_tmpdir() as tmp:
        environment = Env(tmp)
        try:
            yield environment
        finally:
            await environment.close()


async def proxied(env: Env, **plugin_options: Any) -> tuple[FakeKubelet, FakePlugin]:
    """Kubelet, agent and one plugin for RESOURCE, the proxy endpoint registered with the kubelet."""
    kubelet = await env.start_kubelet()
    await env.start_agent()
    plugin = await env.plugin(**plugin_options)
    await wait_until(lambda: RESOURCE in kubelet.options, within=10, what="proxy registered with the kubelet")
    return kubelet, plugin


async def call(socket: Path, method: str, request: bytes) -> tuple[str, bytes | str, dict[str, Any]]:
    """One DevicePlugin RPC as wire bytes: (status code name, response or details, trailing metadata)."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        try:
            response = await channel.unary_unary(f"/v1beta1.DevicePlugin/{method}")(request, timeout=10)
            return "OK", bytes(response), {}
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details() or "", dict(err.trailing_metadata() or ())


async def follow(socket: Path, seen: list[pb.ListAndWatchResponse]) -> str:
    """The kubelet's ListAndWatch on a proxy endpoint: every message into `seen`; how the stream ended."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        try:
            async for message in pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty()):
                seen.append(message)
        except grpc.aio.AioRpcError as err:
            return err.code().name
    return "ended"


async def test_plugin_restarted_with_new_options_registers_the_endpoint_again(env: Env) -> None:
    """A plugin upgraded in place (same socket) that now needs PreStartContainer and offers GetPreferredAllocation:
    the kubelet asks a plugin's options only when it registers, so the proxy registers its endpoint again; a restart
    with unchanged options does not."""
    kubelet, plugin = await proxied(env)
    assert env.agent is not None
    await plugin.stop()
    await wait_until(lambda: env.agent and env.agent.counts(RESOURCE) == (2, 0), within=5, what="plugin gone")
    same = await env.plugin()
    await wait_until(lambda: env.agent and env.agent.counts(RESOURCE) == (2, 2), within=5, what="same plugin back")
    await asyncio.sleep(0.5)  # several reconcile ticks
    assert len(kubelet.registrations) == 1, "unchanged options: nothing new to tell the kubelet"

    await same.stop()
    await wait_until(lambda: env.agent and env.agent.counts(RESOURCE) == (2, 0), within=5, what="plugin gone")
    await env.plugin(pre_start=True, preferred=True)
    await wait_until(lambda: len(kubelet.registrations) == 2, within=5, what="the endpoint registered again")
    options = kubelet.options[RESOURCE]
    assert options.pre_start_required and options.get_preferred_allocation_available, options


async def test_plugin_registering_again_in_place_lets_the_kubelets_call_in_flight_finish(env: Env) -> None:
    """A live plugin registering again on its socket (as plugins do when they see kubelet.sock re-created) replaces
    its connection; a forwarded Allocate still in flight on the old one gets its answer, not CANCELLED: the kubelet
    never cancels calls when a plugin re-registers. Repeated, it leaves no connection open behind it."""
    _kubelet, plugin = await proxied(env)
    assert env.agent is not None
    plugin.allocate_delay = 1.5
    in_flight = asyncio.create_task(call(env.endpoint(), "Allocate", ALLOCATE_D0))
    await asyncio.sleep(0.5)
    await plugin.register(env.plugin_dir / "kubelet.sock")  # same plugin, same socket, registers again
    code, _response, _trailers = await in_flight
    assert code == "OK"

    plugin.allocate_delay = 0.0
    await asyncio.sleep(0.5)
    before = env.agent.open_fds()
    for _ in range(10):
        await plugin.register(env.plugin_dir / "kubelet.sock")
        assert (await call(env.endpoint(), "Allocate", ALLOCATE_D0))[0] == "OK"
    await wait_until(lambda: env.agent and env.agent.open_fds() <= before + 2, within=5, what="old connections closed")


async def test_a_plugin_whose_options_hang_does_not_delay_another_resources_registration(env: Env) -> None:
    """The kubelet's Register for one resource hangs (its plugin never answers the kubelet's GetDevicePluginOptions,
    and the kubelet asks without a deadline); another resource still reaches the kubelet within 1 s (the proxy's
    re-registration bound), not after the hung registration's 10 s timeout."""
    kubelet = await env.start_kubelet()
    await env.start_agent()
    bad = await env.plugin("bad.sock", OTHER, HangingOptionsPlugin)
    assert isinstance(bad, HangingOptionsPlugin)
    await wait_until(lambda: bad.answered >= 2, within=5, what="the kubelet asks the hanging plugin")
    await env.plugin()
    await wait_until(lambda: RESOURCE in kubelet.options, within=1.0, what="the other resource at the kubelet")


async def test_recovered_connection_is_dropped_when_its_socket_now_serves_another_resource(env: Env) -> None:
    """The agent records {RESOURCE: fake.sock} and is killed; meanwhile fake.sock is served by a plugin for OTHER
    (e.g. a reconfigured plugin). The restarted agent re-dials fake.sock for RESOURCE (it cannot tell), but once the
    plugin registers it for OTHER, RESOURCE is disconnected as when its plugin goes away: the kubelet's stream shows
    its devices unhealthy, so OTHER's devices are never advertised as RESOURCE's too."""
    _kubelet, plugin = await proxied(env)
    assert env.agent is not None
    env.agent.stop(signal.SIGKILL)
    await plugin.stop()
    other = await FakePlugin(env.plugin_dir, "fake.sock").start()  # the same socket, now serving OTHER
    other.devices = [pb.Device(ID="b0", health="Healthy"), pb.Device(ID="b1", health="Healthy")]
    env.plugins.append(other)
    agent = await env.start_agent()
    await wait_until(lambda: agent.counts(RESOURCE) == (2, 2), within=10, what="the recorded socket re-dialled")
    seen: list[pb.ListAndWatchResponse] = []
    stream = asyncio.create_task(follow(env.endpoint(), seen))
    try:
        await wait_until(lambda: seen, within=5, what="the kubelet's first message for RESOURCE")
        await other.register(env.plugin_dir / "kubelet.sock", resource=OTHER)
        await wait_until(lambda: agent.counts(OTHER) == (2, 2), within=10, what="OTHER registered")
        await wait_until(
            lambda: {d.health for d in seen[-1].devices} == {"Unhealthy"}, within=2, what="RESOURCE unhealthy"
        )
        resource = agent.resource(RESOURCE)
        assert resource is not None and not resource["plugin"]["connected"], resource
        assert not stream.done(), "the kubelet's stream stays open, as when a plugin goes away"
    finally:
        stream.cancel()


async def test_metadata_change_of_the_proxy_socket_keeps_the_kubelets_stream(env: Env) -> None:
    """chmod (or chown, touch) changes the socket's ctime, not the socket: the endpoint is not served anew, so the
    kubelet's ListAndWatch stays open."""
    await proxied(env)
    seen: list[pb.ListAndWatchResponse] = []
    stream = asyncio.create_task(follow(env.endpoint(), seen))
    try:
        await wait_until(lambda: seen, within=5, what="first message")
        os.chmod(env.endpoint(), 0o700)
        await asyncio.sleep(1.0)  # ten reconcile ticks
        assert not stream.done(), stream.result()
    finally:
        stream.cancel()


async def test_the_plugins_error_trailers_are_forwarded(env: Env) -> None:
    """A plugin's rich error status (grpc-status-details-bin) and other trailing metadata reach the kubelet as they
    reach a direct caller."""
    _kubelet, plugin = await proxied(env)
    details = b"\x08\x09\x12\x04boom"  # a google.rpc.Status: code 9, message "boom"
    trailers = (("grpc-status-details-bin", details), ("x-plugin-reason", "no-capacity"))
    plugin.allocate_abort = (grpc.StatusCode.FAILED_PRECONDITION, "boom", trailers)
    direct = await call(plugin.socket, "Allocate", ALLOCATE_D0)
    proxied_call = await call(env.endpoint(), "Allocate", ALLOCATE_D0)
    assert direct[:2] == ("FAILED_PRECONDITION", "boom")
    assert direct[2]["grpc-status-details-bin"] == details
    assert proxied_call == direct
