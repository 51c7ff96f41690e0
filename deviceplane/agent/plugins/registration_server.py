"""The gRPC server of the Registration service on `<plugin-dir>/kubelet.sock`, kept serving while the agent runs."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import grpc

from deviceplane.agent.plugins.registration import RegistrationServicer
from deviceplane.api.typed_grpc import add_registration, bind_unix_socket
from deviceplane.core.constants import KUBELET_SOCKET_NAME
from deviceplane.unix_sockets import serve_again_when_removed

log = logging.getLogger("deviceplane.agent.plugins.registration")


class RegistrationServer:
    def __init__(self, servicer: RegistrationServicer, plugin_dir: Path) -> None:
        self._servicer = servicer
        self.socket = plugin_dir / KUBELET_SOCKET_NAME
        self._server: grpc.aio.Server | None = None

    def problem(self) -> str | None:
        """None while plugins can register; otherwise why not (the /healthz answer)."""
        if self._server is None or not self.socket.exists():
            return "device plugin registration gRPC server failed and no device plugins can register"
        return None

    async def start(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        server = grpc.aio.server()
        add_registration(self._servicer, server)
        bind_unix_socket(server, self.socket)
        # Ours from the bind on: a start cut short (a stop signal during start) still has stop() remove the socket.
        self._server = server
        await server.start()

    async def keep_serving(self) -> None:
        """Runs until cancelled: when someone removes kubelet.sock, serve again, so plugins watching for it
        re-register. (The kubelet would only fail its health check.) Connected plugins are unaffected."""
        await serve_again_when_removed(self.socket, self.start, "registration", log)

    async def stop(self) -> None:
        if self._server is None:
            return  # never served: the socket there, if any, is not ours
        await self._server.stop(grace=1)
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
