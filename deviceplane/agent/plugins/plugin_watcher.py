"""Plugin-watcher registration (spec §3): sockets appearing in a plugins_registry directory are probed with GetInfo,
validated, connected through the device manager and told the outcome with NotifyRegistrationStatus."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import watchfiles

from deviceplane.agent.plugins.contracts import PluginHandler, RegistrationError
from deviceplane.aio import cancel_and_wait
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplane.api.typed_grpc import plugin_watcher_stub
from deviceplane.core.constants import (
    DIAL_TIMEOUT_SECONDS,
    GET_INFO_TIMEOUT_SECONDS,
    NOTIFY_TIMEOUT_SECONDS,
    PLUGIN_TYPE_DEVICE_PLUGIN,
)
from deviceplane.core.names import (
    any_supported_version,
    invalid_plugin_name_error,
    is_extended_resource_name,
    plugin_versions_unsupported_error,
)

log = logging.getLogger("deviceplane.agent.watcher")


@dataclass(frozen=True, slots=True)
class Registered:
    resource: str
    endpoint: str
    mtime_ns: int


def is_plugin_socket(path: Path) -> bool:
    if path.name.startswith("."):
        return False
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


class PluginWatcher:
    def __init__(self, directory: Path, handler: PluginHandler, dial_timeout: float = DIAL_TIMEOUT_SECONDS) -> None:
        self._directory = directory
        self._handler = handler
        self._dial_timeout = dial_timeout
        self._registered: dict[str, Registered] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, ready: asyncio.Event | None = None) -> None:
        self._directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        stop = asyncio.Event()
        try:
            watcher = watchfiles.awatch(self._directory, recursive=True, stop_event=stop, debounce=50, step=20)
            self.rescan()
            if ready is not None:
                ready.set()
            async for _changes in watcher:
                # Like the kubelet's reconciler, compare desired (sockets on disk) with actual (registered).
                self.rescan()
        finally:
            stop.set()
            await cancel_and_wait(self._tasks)

    def rescan(self) -> None:
        present: dict[str, int] = {}
        for root, _dirs, files in os.walk(self._directory):
            for name in files:
                path = Path(root) / name
                if is_plugin_socket(path):
                    present[str(path)] = os.lstat(path).st_mtime_ns
        for socket_path, mtime in present.items():
            known = self._registered.get(socket_path)
            if known is None or known.mtime_ns != mtime:
                self._spawn(socket_path, mtime)
        for socket_path in list(self._registered):
            if socket_path not in present:
                self._spawn(socket_path, None)

    def _spawn(self, socket_path: str, mtime: int | None) -> None:
        task = asyncio.create_task(self._reconcile(socket_path, mtime), name=f"plugin-watcher {socket_path}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reconcile(self, socket_path: str, mtime: int | None) -> None:
        # Operations on one socket are serialised, as upstream serialises them per plugin.
        lock = self._locks.setdefault(socket_path, asyncio.Lock())
        try:
            async with lock:
                known = self._registered.get(socket_path)
                if known is not None and (mtime is None or known.mtime_ns != mtime):
                    del self._registered[socket_path]
                    await self._handler.deregister(known.resource, known.endpoint, "plugin socket removed")
                    log.info("plugin deregistered", extra={"socket": socket_path})
                if mtime is not None and socket_path not in self._registered:
                    await self._register(socket_path, mtime)
        finally:
            if not lock.locked() and socket_path not in self._registered:
                self._locks.pop(socket_path, None)

    async def _register(self, socket_path: str, mtime: int) -> None:
        async with grpc.aio.insecure_channel(
            f"unix://{socket_path}", options=[("grpc.default_authority", "localhost")]
        ) as channel:
            stub = plugin_watcher_stub(channel)
            try:
                await asyncio.wait_for(channel.channel_ready(), self._dial_timeout)
                info = await stub.GetInfo(reg_pb.InfoRequest(), timeout=GET_INFO_TIMEOUT_SECONDS)
            except (TimeoutError, grpc.aio.AioRpcError) as err:
                log.warning("RegisterPlugin error -- dial failed at socket %s, err: %s", socket_path, err)
                return
            error = await self._connect(socket_path, info)
            if error is None:
                self._registered[socket_path] = Registered(info.name, self._endpoint(socket_path, info), mtime)
            else:
                log.warning("plugin registration failed", extra={"socket": socket_path, "error": error})
            try:
                await stub.NotifyRegistrationStatus(
                    reg_pb.RegistrationStatus(plugin_registered=error is None, error=error or ""),
                    timeout=NOTIFY_TIMEOUT_SECONDS,
                )
            except grpc.aio.AioRpcError as err:
                log.warning("NotifyRegistrationStatus failed at socket %s: %s", socket_path, err.details())

    @staticmethod
    def _endpoint(socket_path: str, info: reg_pb.PluginInfo) -> str:
        if not info.endpoint:
            return socket_path
        return str(Path(socket_path).parent / info.endpoint)

    async def _connect(self, socket_path: str, info: reg_pb.PluginInfo) -> str | None:
        """Upstream's operation_generator steps 3-7; returns the error text sent back to the plugin, if any."""
        if info.type != PLUGIN_TYPE_DEVICE_PLUGIN:
            return f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket {socket_path}"
        # The device manager's ValidatePlugin (spec §3.3): versions first, then the name.
        problem = None
        if not any_supported_version(info.supported_versions):
            problem = plugin_versions_unsupported_error(info.supported_versions)
        elif not is_extended_resource_name(info.name):
            problem = invalid_plugin_name_error(info.name)
        if problem is not None:
            return f"RegisterPlugin error -- plugin validation failed with err: {problem}"
        endpoint = self._endpoint(socket_path, info)
        try:
            await self._handler.register(info.name, endpoint)
        except RegistrationError as err:
            return f"RegisterPlugin error -- plugin registration failed with err: {err}"
        return None
