"""Typed access to protoc's generated `*_pb2_grpc.py` (which carry no annotations): the stubs the agent and the SDK
call, as Protocols, and the functions that add servicers to a server. The messages are typed by the generated .pyi."""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol, cast

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplane.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc

POD_RESOURCES_SERVICE = "v1.PodResourcesLister"


class RegistrationStub(Protocol):
    """v1beta1.Registration: a device plugin registering with the kubelet (or the agent)."""

    def Register(self, request: pb.RegisterRequest, *, timeout: float | None = None) -> Awaitable[pb.Empty]: ...


class PluginWatcherStub(Protocol):
    """pluginregistration.v1.Registration: the kubelet's plugin watcher probing a plugin."""

    def GetInfo(self, request: reg_pb.InfoRequest, *, timeout: float | None = None) -> Awaitable[reg_pb.PluginInfo]: ...

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, *, timeout: float | None = None
    ) -> Awaitable[reg_pb.RegistrationStatusResponse]: ...


def registration_stub(channel: grpc.aio.Channel) -> RegistrationStub:
    return cast(RegistrationStub, pb_grpc.RegistrationStub(channel))  # type: ignore[no-untyped-call]


def plugin_watcher_stub(channel: grpc.aio.Channel) -> PluginWatcherStub:
    return cast(PluginWatcherStub, reg_grpc.RegistrationStub(channel))  # type: ignore[no-untyped-call]


def add_device_plugin(servicer: pb_grpc.DevicePluginServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_DevicePluginServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]


def add_registration(servicer: pb_grpc.RegistrationServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_RegistrationServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]


def add_plugin_watcher_registration(servicer: reg_grpc.RegistrationServicer, server: grpc.aio.Server) -> None:
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]


def add_pod_resources(servicer: pr_grpc.PodResourcesListerServicer, server: grpc.aio.Server) -> None:
    """As the generated `add_PodResourcesListerServicer_to_server`, except that `List` and `GetAllocatableResources`
    answer with their responses already serialized (bytes): the agent keeps each pod's and each resource's part of
    them encoded."""
    handlers = {
        "List": grpc.unary_unary_rpc_method_handler(
            servicer.List,
            request_deserializer=pr.ListPodResourcesRequest.FromString,
            response_serializer=bytes,  # the bytes as they are
        ),
        "GetAllocatableResources": grpc.unary_unary_rpc_method_handler(
            servicer.GetAllocatableResources,
            request_deserializer=pr.AllocatableResourcesRequest.FromString,
            response_serializer=bytes,
        ),
        "Get": grpc.unary_unary_rpc_method_handler(
            servicer.Get,
            request_deserializer=pr.GetPodResourcesRequest.FromString,
            response_serializer=pr.GetPodResourcesResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(POD_RESOURCES_SERVICE, handlers),))
    server.add_registered_method_handlers(POD_RESOURCES_SERVICE, handlers)  # type: ignore[attr-defined]  # grpc-stubs lag


# grpc-stubs makes ServicerContext generic in (request, response); servicers here accept any.
Context = grpc.aio.ServicerContext[Any, Any]


def bind_unix_socket(server: grpc.aio.Server, path: Path) -> None:
    """`add_insecure_port` on a unix socket, failing as an OSError that names the path: grpc raises a RuntimeError
    (a path too long for a socket address, a directory that cannot be written), which start-up does not expect."""
    try:
        bound = server.add_insecure_port(f"unix://{path}")
    except RuntimeError as err:
        raise OSError(f"cannot serve {path}: {err}") from err
    if not bound:
        raise OSError(f"cannot serve {path}")
