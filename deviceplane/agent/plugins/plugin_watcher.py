"""Plugin-watcher registration (spec §3): sockets appearing in a plugins_registry directory are probed with GetInfo,
validated, connected through the device manager and told the outcome with NotifyRegistrationStatus."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import watchfiles
from watchfiles._rust_notify import WatchfilesRustInternalError

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
    is_utf8,
    plugin_versions_unsupported_error,
)

log = logging.getLogger("deviceplane.agent.watcher")

# The kubelet's plugin manager reconciles every second, and retries a registration that failed with exponential
# backoff (its operation executor: 0.5 s doubling to 2 min 2 s), so a plugin whose first GetInfo was slow still
# registers, with no other change in the directory to set it off.
RECONCILE_INTERVAL_SECONDS = 1.0
RETRY_INITIAL_SECONDS = 0.5
RETRY_MAX_SECONDS = 122.0


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
        self._tasks: set[asyncio.Task[None]] = set()
        # Sockets with a reconcile in flight: one at a time per socket, as upstream serialises operations per plugin.
        self._working: set[str] = set()
        # socket -> (its mtime when registering it failed, the next attempt's time, the delay after that one)
        self._retries: dict[str, tuple[int, float, float]] = {}
        # Sockets whose path is not UTF-8, found at the last rescan and logged then (see `_log_undialable`).
        self._undialable: set[str] = set()

    async def run(self, ready: asyncio.Event | None = None) -> None:
        self._directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            self.rescan()
            if ready is not None:
                ready.set()
            self._tasks.add(asyncio.create_task(self._reconcile_every_second(), name="plugin-watcher reconcile"))
            watch_again = True
            while watch_again:
                watch_again = await self._follow_events()
        finally:
            await cancel_and_wait(self._tasks)

    async def _follow_events(self) -> bool:
        """Rescan on every batch of directory events. True when the watch broke and should be made again: watchfiles
        ends its watch with an internal error on an event naming a path that is not UTF-8, which a socket of any
        name in the directory (a plugin's, a tool's) can cause, again and again."""
        stop = asyncio.Event()
        broke = False
        try:
            async for _changes in watchfiles.awatch(
                self._directory, recursive=True, stop_event=stop, debounce=50, step=20
            ):
                # Like the kubelet's reconciler, compare desired (sockets on disk) with actual (registered).
                self.rescan()
        except* WatchfilesRustInternalError as broken:  # awatch raises it inside an ExceptionGroup
            log.warning("plugin registry watch broke; watching again", extra={"error": str(broken.exceptions[0])})
            broke = True
        finally:
            stop.set()
        if broke:  # a pause, so a watch that keeps breaking does not spin; the reconcile loop runs meanwhile
            await asyncio.sleep(RECONCILE_INTERVAL_SECONDS)
        return broke

    async def _reconcile_every_second(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_SECONDS)
            self.rescan()

    def rescan(self) -> None:
        present: dict[str, int] = {}
        undialable: set[str] = set()
        for root, _dirs, files in os.walk(self._directory):
            for name in files:
                path = Path(root) / name
                if not is_plugin_socket(path):
                    continue
                if is_utf8(str(path)):
                    present[str(path)] = os.lstat(path).st_mtime_ns
                else:
                    undialable.add(str(path))
        self._log_undialable(undialable)
        now = asyncio.get_running_loop().time()
        for socket_path, mtime in present.items():
            known = self._registered.get(socket_path)
            if (known is None or known.mtime_ns != mtime) and not self._backing_off(socket_path, mtime, now):
                self._spawn(socket_path, mtime)
        for socket_path in list(self._registered):
            if socket_path not in present:
                self._spawn(socket_path, None)
        for socket_path in list(self._retries):
            if socket_path not in present:
                del self._retries[socket_path]

    def _log_undialable(self, undialable: set[str]) -> None:
        """Once per socket (until it goes): gRPC takes its target as UTF-8 text, so a socket whose path is not UTF-8
        cannot be dialled and is left alone (the kubelet, which reads names as bytes, would dial it)."""
        for socket_path in sorted(undialable - self._undialable):
            log.warning("plugin socket ignored: its path is not UTF-8", extra={"socket": ascii(socket_path)})
        self._undialable = undialable

    def _backing_off(self, socket_path: str, mtime: int, now: float) -> bool:
        """Registering this socket failed and its next attempt is not due (a re-created socket is tried at once)."""
        retry = self._retries.get(socket_path)
        return retry is not None and retry[0] == mtime and now < retry[1]

    def _failed(self, socket_path: str, mtime: int, retry: bool = True) -> None:
        """Try again after the backoff; or, `retry` False, not until the socket is re-created."""
        previous = self._retries.get(socket_path)
        delay = previous[2] if previous is not None and previous[0] == mtime else RETRY_INITIAL_SECONDS
        next_at = asyncio.get_running_loop().time() + delay if retry else math.inf
        self._retries[socket_path] = (mtime, next_at, min(delay * 2, RETRY_MAX_SECONDS))

    def _spawn(self, socket_path: str, mtime: int | None) -> None:
        if socket_path in self._working:
            return  # the next rescan looks again once it is done
        self._working.add(socket_path)
        task = asyncio.create_task(self._reconcile(socket_path, mtime), name=f"plugin-watcher {socket_path}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._working.discard(socket_path))

    async def _reconcile(self, socket_path: str, mtime: int | None) -> None:
        known = self._registered.get(socket_path)
        if known is not None and (mtime is None or known.mtime_ns != mtime):
            del self._registered[socket_path]
            await self._handler.deregister(known.resource, known.endpoint, "plugin socket removed")
            log.info("plugin deregistered", extra={"socket": socket_path})
        if mtime is not None and socket_path not in self._registered:
            await self._register(socket_path, mtime)

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
                self._failed(socket_path, mtime)
                return
            error, retry = await self._connect(socket_path, info)
            if error is None:
                self._registered[socket_path] = Registered(info.name, self._endpoint(socket_path, info), mtime)
                self._retries.pop(socket_path, None)
            else:
                log.warning("plugin registration failed", extra={"socket": socket_path, "error": error})
                self._failed(socket_path, mtime, retry)
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

    async def _connect(self, socket_path: str, info: reg_pb.PluginInfo) -> tuple[str | None, bool]:
        """Upstream's operation_generator steps 3-7: the error text sent back to the plugin, if any, and whether to
        try again. Upstream retries a plugin refused before its handler's RegisterPlugin, but one the handler
        refuses is in its actual state by then: not tried again until its socket changes."""
        if info.type != PLUGIN_TYPE_DEVICE_PLUGIN:
            message = (
                f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket {socket_path}"
            )
            return message, True
        # The device manager's ValidatePlugin (spec §3.3): versions first, then the name.
        problem = None
        if not any_supported_version(info.supported_versions):
            problem = plugin_versions_unsupported_error(info.supported_versions)
        elif not is_extended_resource_name(info.name):
            problem = invalid_plugin_name_error(info.name)
        if problem is not None:
            return f"RegisterPlugin error -- plugin validation failed with err: {problem}", True
        endpoint = self._endpoint(socket_path, info)
        try:
            await self._handler.register(info.name, endpoint)
        except RegistrationError as err:
            return f"RegisterPlugin error -- plugin registration failed with err: {err}", False
        return None, False
