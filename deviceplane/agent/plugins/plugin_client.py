"""One gRPC connection to a device plugin's socket (the kubelet's endpoint.go + client.go), made with the lean
client (deviceplane.lean_grpc): every RPC of the connection, ListAndWatch included, on one HTTP/2 connection, as the
kubelet's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from deviceplane.agent.plugins.contracts import PluginDialError, SnapshotCallback, StreamEndCallback
from deviceplane.aio import cancel_and_wait
from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.core.registry import Device, PluginOptions
from deviceplane.core.snapshot import CORRECTED, SnapshotRules
from deviceplane.lean_grpc import Channel, ResponseStream, RpcError

log = logging.getLogger("deviceplane.agent.plugin")

MessageTap = Callable[[pb.ListAndWatchResponse], None]
MAX_PROBLEMS_LOGGED = 4096
SERVICE = "/v1beta1.DevicePlugin/"
M = TypeVar("M", bound=Message)


def parse(kind: type[M], wire: bytes) -> M:
    """A response message; one that does not parse is the call's failure, worded as grpc-go's."""
    try:
        return kind.FromString(wire)
    except DecodeError as err:
        raise RpcError(grpc.StatusCode.INTERNAL, f"grpc: failed to unmarshal the received message: {err}") from None


def devices_from_proto(devices: Sequence[pb.Device]) -> list[Device]:
    # An unset topology reads as empty nodes: no HasField needed (this runs for every device of every message).
    return [Device(d.ID, d.health, tuple([n.ID for n in d.topology.nodes])) for d in devices]


class PluginClient:
    """Dial, ask for options, stream ListAndWatch, and call the per-allocation RPCs (a `PluginConnection`)."""

    def __init__(
        self,
        resource: str,
        socket_path: str,
        on_message: MessageTap | None = None,
        rules: SnapshotRules = CORRECTED,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        # Sees each ListAndWatch message as received, before it is turned into devices (proxy mode forwards it).
        self._on_message = on_message
        # What each snapshot may not say is corrected (agent mode) or taken as sent (proxy mode: the kubelet's rules).
        self._rules = rules
        self._channel = Channel(socket_path, authority="localhost")  # the kubelet's dialer's authority
        self._stream_task: asyncio.Task[None] | None = None
        self._closed = False
        self._logged: set[tuple[Device, str]] = set()  # snapshot problems already logged
        self._calls = 0  # unary calls in flight
        self._idle: asyncio.Event | None = None  # set when the last call in flight ends, once closing waits for it

    async def connect(self, timeout: float) -> PluginOptions:
        """Dial (blocking, with the kubelet's 10 s timeout) and call GetDevicePluginOptions, under one deadline.

        One round: the call waits for the connection itself (wait_for_ready). The errors are upstream's: a plugin
        that never became reachable fails the dial, one that connected but did not answer (or broke off) fails
        GetDevicePluginOptions. The options the plugin sent in RegisterRequest are ignored, as upstream: the plugin
        is asked.
        """
        try:
            # The request is an Empty, whose wire form is no bytes.
            wire = await self._channel.unary(SERVICE + "GetDevicePluginOptions", b"", timeout, wait_for_ready=True)
            options = parse(pb.DevicePluginOptions, wire)
        except RpcError as err:
            # Under wait_for_ready, an unreachable plugin is the deadline passing with no connection ever made.
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self._channel.connected_once:
                raise PluginDialError(
                    f"failed to dial device plugin: context deadline exceeded ({self.socket_path})"
                ) from err
            raise PluginDialError(f"failed to get device plugin options: {err.go_text()}") from err
        return PluginOptions(options.pre_start_required, options.get_preferred_allocation_available)

    def start_stream(self, on_snapshot: SnapshotCallback, on_end: StreamEndCallback) -> None:
        """Open ListAndWatch now and read it in a task.

        The call is created here, synchronously, so its request is on its way before the caller returns (the
        Register answer): the kubelet starts its ListAndWatch goroutine before Register returns too. Nothing waits
        for the plugin here, so a plugin that sends its first list only once Register has returned still works.
        """
        # No deadline, as upstream: the stream lives as long as the plugin does.
        call = self._channel.stream(SERVICE + "ListAndWatch", b"")
        self._stream_task = asyncio.create_task(
            self._run_stream(call, on_snapshot, on_end), name=f"list-and-watch {self.resource} {self.socket_path}"
        )

    async def _run_stream(
        self,
        call: ResponseStream,
        on_snapshot: SnapshotCallback,
        on_end: StreamEndCallback,
    ) -> None:
        reason = "stream ended"
        try:
            async for wire in call:
                response = parse(pb.ListAndWatchResponse, wire)
                if self._on_message is not None:
                    self._on_message(response)
                on_snapshot(self._checked(devices_from_proto(response.devices)))
        except RpcError as err:
            reason = f"ListAndWatch ended: {err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            reason = "agent stopping"
            raise
        except Exception as err:  # a bug in a callback must not leave the plugin half-connected
            log.exception("ListAndWatch handling failed", extra={"resource": self.resource})
            reason = f"ListAndWatch handling failed: {err}"
        finally:
            call.cancel()  # ended here (a message that did not parse, a failed callback): the plugin hears of it
            if not self._closed:
                await on_end(reason)

    def _checked(self, devices: list[Device]) -> list[Device]:
        """What the plugin may not say (core.snapshot), as the rules handle it; logged once per device and problem."""
        devices, problems = self._rules.apply(devices)
        for device, problem in problems:
            if (device, problem) not in self._logged:
                if len(self._logged) >= MAX_PROBLEMS_LOGGED:
                    self._logged.clear()  # bounded against a plugin inventing ids; at worst it logs again
                self._logged.add((device, problem))
                log.warning(
                    self._rules.logged_as,
                    extra={"resource": self.resource, "device": device.id, "reason": problem},
                )
        return devices

    async def allocate(self, device_ids: Sequence[str], timeout: float | None) -> pb.AllocateResponse:
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(device_ids))])
        return await self._call("Allocate", request, pb.AllocateResponse, timeout)

    async def get_preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, timeout: float | None
    ) -> pb.PreferredAllocationResponse:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
                )
            ]
        )
        return await self._call("GetPreferredAllocation", request, pb.PreferredAllocationResponse, timeout)

    async def pre_start_container(self, device_ids: Sequence[str], timeout: float) -> None:
        request = pb.PreStartContainerRequest(devices_ids=list(device_ids))
        await self._call("PreStartContainer", request, pb.PreStartContainerResponse, timeout)

    async def _call(self, method: str, request: Message, reply: type[M], timeout: float | None) -> M:
        return parse(reply, await self.call_raw(method, request.SerializeToString(), timeout))

    @property
    def closed(self) -> bool:
        return self._closed

    async def call_raw(
        self, method: str, request: bytes, timeout: float | None, sent_timeout: float | None = None
    ) -> bytes:
        """One unary DevicePlugin RPC (e.g. "Allocate") with request and response as wire bytes, so a proxy forwards
        exactly what it got. Raises RpcError with the plugin's status. `sent_timeout`: the deadline the plugin is
        told, when it is to be shorter than ours (`timeout`)."""
        self._calls += 1
        try:
            return await self._channel.unary(SERVICE + method, request, timeout, sent_timeout=sent_timeout)
        finally:
            self._calls -= 1
            if self._calls == 0 and self._idle is not None:
                self._idle.set()

    async def close(self) -> None:
        """Stop the stream (without reporting it as a disconnect) and close the channel: calls in flight fail."""
        self._closed = True
        await self._stop_stream()
        await self._channel.close()

    async def close_after_calls(self, limit: float) -> None:
        """Stop the stream now (without reporting it as a disconnect); close the channel once the unary calls in
        flight have ended, or after `limit` seconds (those left then fail), or when cancelled."""
        self._closed = True
        try:
            await self._stop_stream()
            if self._calls:
                self._idle = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), limit)
        finally:
            await self._channel.close()

    async def _stop_stream(self) -> None:
        task, self._stream_task = self._stream_task, None
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait([task])
