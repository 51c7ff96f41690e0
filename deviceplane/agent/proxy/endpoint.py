"""One proxy endpoint: a socket in the kubelet's device-plugin directory serving a resource's forwarder, and its
registration with the kubelet's `kubelet.sock`."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.typed_grpc import registration_stub
from deviceplane.core.constants import VERSION
from deviceplane.core.registry import PluginOptions
from deviceplane.unix_sockets import MAX_SOCKET_PATH, SocketIdentity, socket_identity

log = logging.getLogger("deviceplane.agent.proxy")

SOCKET_PREFIX = "deviceplane-proxy-"


def endpoint_name(resource: str, directory: Path) -> str:
    """The socket file name of a resource's proxy endpoint: stable, so a restarted agent replaces its own. Readable
    when the path fits a unix socket address (107 bytes), else a hash of the resource name."""
    name = SOCKET_PREFIX + resource.replace("/", "_") + ".sock"
    if len(os.fsencode(directory / name)) > MAX_SOCKET_PATH:
        name = SOCKET_PREFIX + hashlib.sha256(resource.encode()).hexdigest()[:16] + ".sock"
    return name


def device_plugin_options(options: PluginOptions) -> pb.DevicePluginOptions:
    """A plugin's options as the DevicePlugin API states them (in a RegisterRequest, or GetDevicePluginOptions)."""
    return pb.DevicePluginOptions(
        pre_start_required=options.pre_start_required,
        get_preferred_allocation_available=options.get_preferred_allocation_available,
    )


def remove_stale_endpoints(kubelet_dir: Path) -> list[str]:
    """A previous agent's proxy sockets (after SIGKILL nobody removed them)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in kubelet_dir.iterdir():
            if entry.name.startswith(SOCKET_PREFIX) and entry.is_socket():
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry.name)
    return removed


class ProxyEndpoint:
    def __init__(self, resource: str, kubelet_dir: Path, handler: grpc.GenericRpcHandler[bytes, bytes]) -> None:
        self.resource = resource
        self.name = endpoint_name(resource, kubelet_dir)
        self.socket_path = kubelet_dir / self.name
        self._handler = handler
        self._server: grpc.aio.Server | None = None
        self._identity: SocketIdentity | None = None
        # The kubelet.sock (identity) this endpoint is registered with, and the options it was registered with (the
        # kubelet asks for them only then); None until registered, after re-serving, and once withdrawn.
        self._registered_with: tuple[SocketIdentity, PluginOptions] | None = None
        # The options of the last registration on this socket: what the kubelet believes until it registers again
        # (kept when withdrawn: the kubelet's client may still be there).
        self._told: PluginOptions | None = None
        self.withdrawn = False  # its registration given up, so that the kubelet drops its client before a new one

    @property
    def serving(self) -> bool:
        return self._server is not None

    def registered_with(self, kubelet: SocketIdentity, options: PluginOptions) -> bool:
        return self._registered_with == (kubelet, options)

    def registered_with_kubelet(self, kubelet: SocketIdentity) -> bool:
        return self._registered_with is not None and self._registered_with[0] == kubelet

    @property
    def told_options(self) -> PluginOptions | None:
        """The options the kubelet was told at this socket's last registration; None when not registered on it."""
        return self._told

    def withdraw(self) -> None:
        """Registration due again (the caller ended the kubelet's streams so that it drops its client)."""
        self._registered_with = None
        self.withdrawn = True

    async def ensure_serving(self) -> bool:
        """Serve on the socket; when the socket is gone or replaced (the kubelet deletes every socket in its
        directory when it starts), serve anew. True when it (re)started."""
        if self._server is not None and socket_identity(self.socket_path) == self._identity:
            return False
        await self._stop_server()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self._handler,))
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server
        self._identity = socket_identity(self.socket_path)
        self._registered_with = None
        self._told = None
        self.withdrawn = False
        return True

    async def register(
        self, kubelet_socket: Path, kubelet: SocketIdentity, options: PluginOptions, timeout: float
    ) -> None:
        """RegisterRequest to the kubelet (whose socket has identity `kubelet`) with the plugin's own options; the
        kubelet dials back within the call, and asks the options. Registering again is the kubelet's ordinary
        re-registration: it replaces its client for the resource (it keeps the old one's ListAndWatch open)."""
        serving = self._server
        request = pb.RegisterRequest(
            version=VERSION,
            endpoint=self.name,
            resource_name=self.resource,
            options=device_plugin_options(options),
        )
        async with grpc.aio.insecure_channel(
            f"unix://{kubelet_socket}", options=[("grpc.default_authority", "localhost")]
        ) as channel:
            await registration_stub(channel).Register(request, timeout=timeout)
        if self._server is serving:  # served anew meanwhile: the kubelet may have lost this registration
            self._registered_with = (kubelet, options)
            self._told = options
            self.withdrawn = False

    async def _stop_server(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    async def close(self) -> None:
        await self._stop_server()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
