"""The plugin's side of registration: one `Register` call to the kubelet (or agent) on `kubelet.sock`."""

from __future__ import annotations

from pathlib import Path

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.typed_grpc import registration_stub
from deviceplane.core.constants import VERSION

# The kubelet dials the plugin back (up to 10 s) before it answers Register.
REGISTER_TIMEOUT = 15.0


async def register(
    kubelet_socket: Path,
    endpoint: str,
    resource: str,
    options: pb.DevicePluginOptions,
    timeout: float = REGISTER_TIMEOUT,
) -> None:
    """Register `resource` served on `endpoint` (a file name next to kubelet.sock). Raises grpc.aio.AioRpcError."""
    async with grpc.aio.insecure_channel(f"unix:{kubelet_socket}") as channel:
        stub = registration_stub(channel)
        request = pb.RegisterRequest(version=VERSION, endpoint=endpoint, resource_name=resource, options=options)
        await stub.Register(request, timeout=timeout)
