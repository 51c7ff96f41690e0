"""The gRPC services a plugin serves on its socket: v1beta1.DevicePlugin and pluginregistration.Registration.

Both are always served (as the kubelet's own stub does): the Registration service is only used when the plugin is
found through a plugins_registry directory, and costs nothing otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplane.api.pluginregistration.v1 import api_pb2_grpc as reg_pb_grpc
from deviceplane.api.typed_grpc import Context, add_device_plugin, add_plugin_watcher_registration
from deviceplane.core.constants import PLUGIN_TYPE_DEVICE_PLUGIN, SUPPORTED_VERSIONS
from deviceplane.plugin.devices import DeviceSet
from deviceplane.plugin.hooks import AllocateHook, PreferredAllocationHook, PreStartHook, abort, call_hook
from deviceplane.plugin.models import Allocation

log = logging.getLogger("deviceplane.plugin")


@dataclass(frozen=True)
class Hooks:
    allocate: AllocateHook | None = None
    get_preferred_allocation: PreferredAllocationHook | None = None
    pre_start_container: PreStartHook | None = None

    def options(self) -> pb.DevicePluginOptions:
        # The kubelet asks for these instead of trusting RegisterRequest.options (spec §4.2), so derive them from
        # what the plugin actually implements: a flag without a hook would make the kubelet call into nothing.
        return pb.DevicePluginOptions(
            pre_start_required=self.pre_start_container is not None,
            get_preferred_allocation_available=self.get_preferred_allocation is not None,
        )


class DevicePluginService(pb_grpc.DevicePluginServicer):
    def __init__(self, devices: DeviceSet, hooks: Hooks, on_stream_end: Callable[[], None] = lambda: None) -> None:
        self._devices = devices
        self._hooks = hooks
        self._on_stream_end = on_stream_end

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Context) -> pb.DevicePluginOptions:
        return self._hooks.options()

    async def ListAndWatch(self, request: pb.Empty, context: Context) -> AsyncIterator[pb.ListAndWatchResponse]:
        try:
            # aclosing: the watch must be closed (and no longer counted) before on_stream_end looks at the count.
            async with contextlib.aclosing(self._devices.watch()) as snapshots:
                async for snapshot in snapshots:
                    yield snapshot.message
        finally:
            # However it ended (the kubelet hung up, the plugin stopped): the plugin decides whether that matters.
            self._on_stream_end()

    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.AllocateResponse:
        known = self._devices.current.by_id
        requested = [list(container.devices_ids) for container in request.container_requests]
        # Every container's ids are checked before any hook runs: a refused request has no side effects, and hooks
        # can trust their input. The checks and their wording are the kubelet sample plugin's (spec §7.2).
        for ids in requested:
            for device_id in ids:
                device = known.get(device_id)
                if device is None:
                    await abort(context, f"invalid allocation request with non-existing device {device_id}")
                if not device.healthy:
                    await abort(context, f"invalid allocation request with unhealthy device: {device_id}")
        response = pb.AllocateResponse()
        for ids in requested:
            response.container_responses.append(await self._allocate_one(ids, context))
        return response

    async def _allocate_one(self, ids: list[str], context: Context) -> pb.ContainerAllocateResponse:
        if self._hooks.allocate is None:
            return pb.ContainerAllocateResponse()
        result = await call_hook("allocate", self._hooks.allocate, context, ids)
        if result is None:
            return pb.ContainerAllocateResponse()
        if isinstance(result, Allocation):
            try:
                return result.to_proto()
            except (TypeError, ValueError) as err:
                log.error("allocate hook returned an invalid Allocation: %s", err)
                await abort(context, f"allocate: hook returned an invalid Allocation: {err}")
        if isinstance(result, pb.ContainerAllocateResponse):
            return result
        await abort(context, f"allocate: hook returned {type(result).__name__}, expected Allocation or None")

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Context
    ) -> pb.PreferredAllocationResponse:
        response = pb.PreferredAllocationResponse()
        for container in request.container_requests:
            chosen: list[str] = []
            if self._hooks.get_preferred_allocation is not None:
                result = await call_hook(
                    "get_preferred_allocation",
                    self._hooks.get_preferred_allocation,
                    context,
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    int(container.allocation_size),
                )
                chosen = await _device_ids(result, context)
            response.container_responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return response

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Context
    ) -> pb.PreStartContainerResponse:
        if self._hooks.pre_start_container is not None:
            ids = list(request.devices_ids)
            known = self._devices.current.by_id
            for device_id in ids:  # as Allocate: the hook only sees devices the plugin lists
                if device_id not in known:
                    await abort(context, f"invalid pre-start request with non-existing device {device_id}")
            await call_hook("pre_start_container", self._hooks.pre_start_container, context, ids)
        return pb.PreStartContainerResponse()


async def _device_ids(result: Any, context: Context) -> list[str]:
    """A preferred-allocation hook's answer as ids. A lone str (or bytes) is refused rather than iterated, which
    would make each character an id: returning "gpu-1" for ["gpu-1"] is an easy slip, better reported."""
    if not isinstance(result, (str, bytes)):
        try:
            return [str(device_id) for device_id in result]
        except TypeError:
            pass
    await abort(
        context,
        f"get_preferred_allocation: hook returned {type(result).__name__}, expected a list of device ids",
    )


class RegistrationService(reg_pb_grpc.RegistrationServicer):
    """What the kubelet's plugin watcher asks a socket in plugins_registry (spec §3.2)."""

    def __init__(self, resource: str, on_status: Callable[[bool, str], None]) -> None:
        self._resource = resource
        self._on_status = on_status

    async def GetInfo(self, request: reg_pb.InfoRequest, context: Context) -> reg_pb.PluginInfo:
        # endpoint "" = "the DevicePlugin service is on this same socket".
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE_DEVICE_PLUGIN, name=self._resource, endpoint="", supported_versions=SUPPORTED_VERSIONS
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: Context
    ) -> reg_pb.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return reg_pb.RegistrationStatusResponse()


def build_server(
    devices: DeviceSet,
    hooks: Hooks,
    resource: str,
    on_status: Callable[[bool, str], None],
    on_stream_end: Callable[[], None] = lambda: None,
) -> grpc.aio.Server:
    server = grpc.aio.server()
    add_device_plugin(DevicePluginService(devices, hooks, on_stream_end), server)
    add_plugin_watcher_registration(RegistrationService(resource, on_status), server)
    return server
