"""DevicePlugin: serve a resource's devices, register them, and stay registered across kubelet/agent restarts."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from watchfiles import Change

from deviceplane import stop_signals
from deviceplane.aio import cancel_and_wait, off_loop
from deviceplane.core.constants import DEVICE_PLUGIN_PATH, KUBELET_SOCKET_NAME
from deviceplane.plugin.devices import DeviceSet
from deviceplane.plugin.hooks import AllocateHook, PreferredAllocationHook, PreStartHook
from deviceplane.plugin.models import Device
from deviceplane.plugin.names import MAX_SOCKET_PATH, check_resource_name, socket_file_name, socket_name_pattern
from deviceplane.plugin.registration import register
from deviceplane.plugin.service import Hooks, build_server
from deviceplane.plugin.signals import stop_on_signals
from deviceplane.plugin.supervise import keep_running
from deviceplane.plugin.watch import dir_changes
from deviceplane.unix_sockets import SocketIdentity, kubelet_socket_identity, socket_identity

log = logging.getLogger("deviceplane.plugin")

DEFAULT_PLUGIN_DIR = Path(DEVICE_PLUGIN_PATH)
# Environment fallbacks, so an unmodified plugin script can be pointed elsewhere (tests, containers).
PLUGIN_DIR_ENV = "DEVICEPLANE_PLUGIN_DIR"
REGISTRY_DIR_ENV = "DEVICEPLANE_REGISTRY_DIR"

RETRY_INITIAL = 0.1
RETRY_MAX = 5.0
# When the kubelet ends the plugin's last ListAndWatch stream and opens no other within this long (it opens one right
# after Register answers), the plugin registers again; the wait doubles up to RESTREAM_MAX while the kubelet keeps
# dropping it, and starts over once the last such registration is RESTREAM_RESET_AFTER seconds old.
RESTREAM_INITIAL = 1.0
RESTREAM_MAX = 60.0
RESTREAM_RESET_AFTER = 300.0


class PluginError(Exception):
    """The plugin cannot start: a message for humans, no traceback needed."""


class DevicePlugin:
    """A device plugin for one extended resource.

    `devices` can be replaced at any time (`set_devices`, from any thread); hooks may be plain or `async` functions
    and are optional - the options the kubelet sees follow from which ones are given:

    - `allocate(device_ids) -> Allocation | None`, once per container;
    - `get_preferred_allocation(available, must_include, size) -> device ids`;
    - `pre_start_container(device_ids) -> None`.

    A hook that raises - anything, SystemExit and KeyboardInterrupt included - fails that one RPC (gRPC status
    UNKNOWN with the hook's name and the exception) and is logged with its traceback.
    Registration goes to `<plugin_dir>/kubelet.sock`, or - with `registry_dir` - through the kubelet's
    plugins_registry directory (the plugin's socket is placed there and answers GetInfo).
    """

    def __init__(
        self,
        resource: str,
        devices: Iterable[Device] = (),
        *,
        allocate: AllocateHook | None = None,
        get_preferred_allocation: PreferredAllocationHook | None = None,
        pre_start_container: PreStartHook | None = None,
        plugin_dir: str | os.PathLike[str] | None = None,
        registry_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        check_resource_name(resource)
        self.resource = resource
        self._devices = DeviceSet(devices)
        self._hooks = Hooks(allocate, get_preferred_allocation, pre_start_container)
        self.plugin_dir = Path(plugin_dir or os.environ.get(PLUGIN_DIR_ENV) or DEFAULT_PLUGIN_DIR).absolute()
        registry = registry_dir or os.environ.get(REGISTRY_DIR_ENV)
        self.registry_dir = Path(registry).absolute() if registry else None
        self.socket_path = (self.registry_dir or self.plugin_dir) / socket_file_name(resource)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        # stop() before serve() has set up its loop: remembered here, honoured by the next serve().
        self._stop_lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._stop_early = False
        self._server: grpc.aio.Server | None = None
        self._serving: SocketIdentity | None = None
        self._watch_stop = threading.Event()
        self._need_register = asyncio.Event()
        self._register_in_flight = False
        self._registered_with: SocketIdentity | None = None
        self._streams_gone = asyncio.Event()  # set when the last ListAndWatch stream ended while serving
        self._serve_lock = asyncio.Lock()  # one (re)start of the gRPC server at a time
        self.registrations = 0  # successful registrations so far (observability, tests)

    # -- devices ---------------------------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._devices.current.devices

    def set_devices(self, devices: Iterable[Device]) -> None:
        """Replace the device list; every ListAndWatch stream gets the new full snapshot if anything changed.

        ValueError (DeviceListTooLarge) for a list the kubelet could not receive in one message (over 4 MiB); the
        current list stays then."""
        self._devices.replace(devices)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or `stop()`: the blocking entry point for plain scripts."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # not inside the except block: every traceback logged while serving would start with this error
        else:
            raise RuntimeError("DevicePlugin.run() blocks; inside asyncio code use `await plugin.serve()`")
        stop_signals.run(self.serve())  # the process is the plugin: only the first stop signal counts

    def stop(self) -> None:
        """Ask `serve()` to return (safe from any thread and from signal handlers); before `serve()` runs, it makes
        the next `serve()` return at once."""
        with self._stop_lock:
            loop, requested = self._loop, self._stop_requested
            if loop is None or requested is None or loop.is_closed():
                self._stop_early = True
                return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            requested.set()
        else:
            loop.call_soon_threadsafe(requested.set)

    async def serve(self, *, handle_signals: bool = True) -> None:
        """Serve, register and keep registered until `stop()`, SIGTERM/SIGINT (if `handle_signals`) or cancellation.

        Raises PluginError if the socket cannot be created. On return the plugin's socket is gone.
        """
        if self._loop is not None:
            raise RuntimeError(f"plugin {self.resource} is already serving")
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise PluginError(f"socket path {self.socket_path} is longer than {MAX_SOCKET_PATH} bytes")
        self._prepare_directory(self.socket_path.parent)
        await off_loop(self._remove_stale_sockets)
        with self._stop_lock:
            self._loop = asyncio.get_running_loop()
            self._stop_requested = asyncio.Event()
            if self._stop_early:
                self._stop_early = False
                self._stop_requested.set()
        self._need_register = asyncio.Event()
        self._streams_gone = asyncio.Event()
        self._serve_lock = asyncio.Lock()
        self._registered_with = None
        self._watch_stop.clear()
        self._devices.attach(self._loop)
        tasks: list[asyncio.Task[Any]] = []
        signals = stop_on_signals(self.stop) if handle_signals else contextlib.nullcontext()
        try:
            with signals:
                if self._stop_requested.is_set():
                    return  # stop() came before serve(): nothing to serve
                await self._start_server()
                tasks.append(self._supervised("watch", self._watch))
                tasks.append(self._supervised("restream", self._restream_loop))
                if self.registry_dir is None:
                    self._need_register.set()
                    tasks.append(self._supervised("register", self._register_loop))
                else:
                    log.info("%s: serving on %s for the kubelet's plugin watcher", self.resource, self.socket_path)
                await self._stop_requested.wait()
        finally:
            await self._shutdown(tasks)

    def _supervised(self, what: str, factory: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        # A failing task is logged and restarted: it neither ends the plugin nor leaves it half-working.
        name = f"{self.resource} {what}"
        return asyncio.create_task(keep_running(name, factory), name=name)

    async def _shutdown(self, tasks: list[asyncio.Task[Any]]) -> None:
        self._watch_stop.set()  # before cancelling: lets the watcher's thread return promptly
        await cancel_and_wait(tasks)
        self._devices.close()  # also detaches it from the loop
        await self._stop_server()
        self._loop = None
        log.info("%s: stopped", self.resource)

    # -- the gRPC server on our socket ----------------------------------------------------------------------

    def _prepare_directory(self, directory: Path) -> None:
        if directory.exists() and not directory.is_dir():
            raise PluginError(f"{directory} is not a directory")
        try:
            # The kubelet creates it too; a plugin started first must not fail for that.
            directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as err:
            raise PluginError(f"cannot create {directory}: {err.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PluginError(f"cannot create a socket in {directory}: permission denied")

    def _remove_stale_sockets(self) -> None:
        """Remove this resource's sockets that nobody serves any more: instances killed with SIGKILL, or by the
        OOM killer, never removed theirs, and each new instance has a name of its own, so they piled up (the kubelet
        only cleans its directory when it restarts; the plugin watcher keeps failing on them). Only names this
        resource's instances take, and only sockets that refuse a connection: a live one - another instance of a
        surge rollout - is never touched, nor is anything another resource owns."""
        pattern = socket_name_pattern(self.resource)
        directory = self.socket_path.parent
        try:
            names = [name for name in os.listdir(directory) if pattern.fullmatch(name)]
        except OSError as err:
            log.warning("%s: cannot look for stale sockets in %s: %s", self.resource, directory, err.strerror)
            return
        for name in names:
            path = directory / name
            if _refuses_connections(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                log.info("%s: removed %s: a stale socket of an instance that is gone", self.resource, path)

    def _on_registration_status(self, registered: bool, error: str) -> None:
        if registered:
            self.registrations += 1
            log.info("%s: registered through the plugin watcher", self.resource)
        else:
            log.error("%s: registration rejected: %s", self.resource, error)

    async def _start_server(self) -> None:
        # Bound under a hidden staging name, then hard-linked into place: gRPC unlinks the path it bound when it
        # stops, and that must never be our public path, which by then may be another process's socket.
        staging = self.socket_path.with_name(f".{secrets.token_hex(4)}.sock")
        server = build_server(
            self._devices, self._hooks, self.resource, self._on_registration_status, self._on_stream_end
        )
        try:
            bound = server.add_insecure_port(f"unix:{staging}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise PluginError(f"cannot listen on {staging}")
        await server.start()
        self._server = server
        try:
            self._publish(staging)
        finally:
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
        self._serving = socket_identity(self.socket_path)
        log.info("%s: serving DevicePlugin on %s", self.resource, self.socket_path)

    def _publish(self, staging: Path) -> None:
        """Link the socket at `socket_path`, or at a new name if something is there: never replace a file."""
        while True:
            try:
                os.link(staging, self.socket_path)
                return
            except FileExistsError:
                self._take_new_socket_name()
            except OSError as err:
                raise PluginError(f"cannot create {self.socket_path}: {err.strerror}") from None

    def _take_new_socket_name(self) -> None:
        # Ours is removed when we stop, so whatever is at our path belongs to someone else (a plugin that took the
        # name, or a stale file). Taking the path back would make both plugins cut the kubelet's stream in turn.
        old = self.socket_path
        self.socket_path = old.with_name(socket_file_name(self.resource))
        log.warning("%s: %s is taken by someone else; serving on %s instead", self.resource, old, self.socket_path)

    async def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            # Brief grace so in-flight Allocate calls complete; streams were already ended by DeviceSet.close().
            await server.stop(grace=0.5)
        # gRPC only unlinked the staging name: remove our socket, but never one someone else created there since.
        if self._serving is not None and socket_identity(self.socket_path) == self._serving:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self._serving = None

    # -- staying registered ------------------------------------------------------------------------------------

    @property
    def _kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET_NAME

    async def _watch(self) -> None:
        async for changes in dir_changes(self.socket_path.parent, self._watch_stop):
            await self._check(changes)

    async def _check(self, changes: set[tuple[Change, str]]) -> None:
        """React to a batch of directory changes (or a quiet tick) by comparing state, not just trusting events."""
        async with self._serve_lock:
            current = socket_identity(self.socket_path)
            if self._server is None or self._serving is None or current != self._serving:
                if self._server is not None:
                    self._log_socket_lost(current)
                if not await self._serve_anew():
                    return
                self._need_register.set()
        if self.registry_dir is not None:
            return
        kubelet = kubelet_socket_identity(self._kubelet_socket)
        recreated = (Change.added, KUBELET_SOCKET_NAME) in changes
        if kubelet is not None and (recreated or (not self._register_in_flight and kubelet != self._registered_with)):
            self._need_register.set()

    def _log_socket_lost(self, current: SocketIdentity | None) -> None:
        if current is None:
            # The kubelet deletes every socket in its directory when it restarts (spec §1.4).
            log.warning("%s: %s was removed; serving again", self.resource, self.socket_path)
        else:
            log.warning(
                "%s: %s was replaced by another process's socket; leaving it to that process",
                self.resource,
                self.socket_path,
            )

    def _on_stream_end(self) -> None:
        stopping = self._stop_requested is not None and self._stop_requested.is_set()
        if self._devices.streams == 0 and not stopping:
            self._streams_gone.set()

    async def _restream_loop(self) -> None:
        """Register again when the kubelet dropped the plugin: its last ListAndWatch stream ended while the plugin
        serves, and no new one opened. The kubelet never dials a plugin back by itself, so the resource would stay
        at allocatable 0 for good - e.g. after a surge rollout's old instance stopped (kubelets up to v1.36 then
        also end the new instance's stream: kubernetes#121994), or after the kubelet refused a message."""
        delay, last = RESTREAM_INITIAL, -RESTREAM_RESET_AFTER
        while True:
            await self._streams_gone.wait()
            self._streams_gone.clear()
            if time.monotonic() - last >= RESTREAM_RESET_AFTER:
                delay = RESTREAM_INITIAL
            await asyncio.sleep(delay)
            if self._devices.streams or self._register_in_flight or self._need_register.is_set():
                continue  # a new stream is open, or a registration is under way (the kubelet restarted)
            if self.registry_dir is None and kubelet_socket_identity(self._kubelet_socket) is None:
                continue  # no kubelet: registering waits for kubelet.sock anyway
            log.warning(
                "%s: the kubelet ended the ListAndWatch stream and opened no new one within %.0f s (it dropped the "
                "plugin); registering again",
                self.resource,
                delay,
            )
            last = time.monotonic()
            delay = min(delay * 2, RESTREAM_MAX)
            if self.registry_dir is None:
                self._need_register.set()
            else:
                # The plugin watcher registers a socket when it appears: a new one at the same path.
                async with self._serve_lock:
                    await self._serve_anew()

    async def _serve_anew(self) -> bool:
        """Under `_serve_lock`: stop serving (another process's socket at the path is left alone) and serve again
        at the path; False when that cannot be done now (not fatal: the watch's next change or tick retries)."""
        if self._server is not None:
            await self._stop_server()
        try:
            self._prepare_directory(self.socket_path.parent)  # it may have been removed with the socket
            await self._start_server()
        except PluginError as err:
            log.error("%s: cannot serve again: %s", self.resource, err)
            return False
        self._registered_with = None
        return True

    async def _register_loop(self) -> None:
        try:
            await self._register_until_cancelled()
        finally:
            self._register_in_flight = False  # a crashed run must not stop the watcher from asking again

    async def _register_until_cancelled(self) -> None:
        delay = RETRY_INITIAL
        last_error = ""
        while True:
            await self._need_register.wait()
            self._need_register.clear()
            target = kubelet_socket_identity(self._kubelet_socket)
            self._register_in_flight = True
            try:
                if target is None:
                    raise FileNotFoundError(f"{self._kubelet_socket} does not exist (yet)")
                await register(self._kubelet_socket, self.socket_path.name, self.resource, self._hooks.options())
            except (grpc.aio.AioRpcError, OSError) as err:
                message = (err.details() or str(err.code())) if isinstance(err, grpc.aio.AioRpcError) else str(err)
                if message != last_error:  # one line per distinct problem, not one per retry
                    log.warning("%s: registration failed, will retry: %s", self.resource, message)
                    last_error = message
                self._register_in_flight = False
                # Sleep, but wake at once when the watcher sees kubelet.sock appear.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._need_register.wait(), delay)
                self._need_register.set()
                delay = min(delay * 2, RETRY_MAX)
                continue
            self._register_in_flight = False
            self._registered_with = target
            self.registrations += 1
            delay, last_error = RETRY_INITIAL, ""
            log.info("%s: registered with %s as %s", self.resource, self._kubelet_socket, self.socket_path.name)


def _refuses_connections(path: Path) -> bool:
    """A unix socket at `path` with nobody listening: connect() fails with ECONNREFUSED. Anything else (a listener,
    a full backlog, no permission, not a socket) is left alone."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(os.fsencode(path))
        except OSError as err:
            return err.errno == errno.ECONNREFUSED
    return False
