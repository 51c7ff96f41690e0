"""The gRPC server of the Registration service on `<plugin-dir>/kubelet.sock`, kept serving while the agent runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc

from deviceplane.agent.plugins.registration import RegistrationServicer
from deviceplane.api.typed_grpc import add_registration, bind_unix_socket
from deviceplane.core.constants import KUBELET_SOCKET_NAME

log = logging.getLogger("deviceplane.agent.plugins.registration")

SOCKET_CHECK_INTERVAL_SECONDS = 1.0


class RegistrationServer:
    def __init__(self, servicer: RegistrationServicer, plugin_dir: Path) -> None:
        self._servicer = servicer
        self._plugin_dir = plugin_dir
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
        while True:
            await asyncio.sleep(SOCKET_CHECK_INTERVAL_SECONDS)
            if self.socket.exists():
                continue
            log.warning("registration socket disappeared; serving again", extra={"socket": str(self.socket)})
            try:
                self._plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
                await self.start()
            except (OSError, RuntimeError) as err:
                log.error("cannot serve the registration socket: %s", err)

    async def stop(self) -> None:
        if self._server is None:
            return  # never served: the socket there, if any, is not ours
        await self._server.stop(grace=1)
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
