"""Test peers for the plugin SDK: reference plugins as real processes, and minimal kubelet stand-ins.

`FakeKubelet` is a real v1beta1.Registration server on a real unix socket that does what the kubelet does on
Register (dial the plugin back, GetDevicePluginOptions, then ListAndWatch), recording everything it sees.
`FakePluginWatcher` does the kubelet plugin watcher's part for a plugins_registry directory (spec §3.2).
They let the SDK be tested independently of our agent; the agent-based tests use the real agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplane.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplane.api.pluginregistration.v1 import api_pb2 as reg_pb
from deviceplane.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from tests.support.procs import ROOT, child_env

T = TypeVar("T")


@contextlib.contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A short temp dir: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dpp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def wait_until(check: Callable[[], T | Awaitable[T]], within: float = 10.0, what: str = "condition") -> T:
    """Poll `check` (sync or async) every 20 ms until it returns something truthy; fail after `within` s."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            result = check()
            value = await result if isinstance(result, Awaitable) else result
        except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError, grpc.RpcError) as err:
            last = err  # not ready yet (process starting, resource not there): keep polling
        else:
            if value:
                return value  # type: ignore[no-any-return]
            last = value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(0.02)


def snapshot_view(response: pb.ListAndWatchResponse) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{id: (health, numa nodes)} - what a ListAndWatch message says, comparable in assertions."""
    return {d.ID: (d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices}


# --------------------------------------------------------------------------------------------------------------
# Kubelet stand-ins


@dataclass
class Connection:
    """The fake kubelet's view of one registered plugin."""

    resource: str
    socket: Path
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions
    snapshots: list[dict[str, tuple[str, tuple[int, ...]]]] = field(default_factory=list)
    stream_ended: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def latest(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        return self.snapshots[-1] if self.snapshots else None

    async def _follow(self) -> None:
        try:
            async for response in self.stub.ListAndWatch(pb.Empty()):
                self.snapshots.append(snapshot_view(response))
        except grpc.aio.AioRpcError:
            pass
        finally:
            self.stream_ended = True

    def start(self) -> None:
        self.task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.channel.close()


async def connect(resource: str, socket: Path) -> Connection:
    """Dial a plugin like the kubelet: options first, then follow ListAndWatch."""
    channel = grpc.aio.insecure_channel(f"unix:{socket}")
    stub = pb_grpc.DevicePluginStub(channel)
    try:
        options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
    except BaseException:
        await channel.close()
        raise
    connection = Connection(resource, socket, channel, stub, options)
    connection.start()
    return connection


class FakeKubelet(pb_grpc.RegistrationServicer):
    """v1beta1.Registration on `<plugin_dir>/kubelet.sock`."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / "kubelet.sock"
        self.requests: list[pb.RegisterRequest] = []
        self.connections: list[Connection] = []
        self._server: grpc.aio.Server | None = None

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.Empty:
        self.requests.append(request)
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.UNKNOWN, f'requested API version "{request.version}" is not supported')
        try:
            connection = await connect(request.resource_name, self.plugin_dir / request.endpoint)
        except grpc.aio.AioRpcError as err:
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {err.details()}")
        self.connections.append(connection)
        return pb.Empty()

    async def start(self) -> FakeKubelet:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self._server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket}")
        await self._server.start()
        return self

    async def stop(self) -> None:
        """Like a kubelet that goes away: registration socket gone, plugin connections closed."""
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        for connection in self.connections:
            await connection.close()

    def latest(self, resource: str) -> Connection | None:
        matching = [c for c in self.connections if c.resource == resource]
        return matching[-1] if matching else None


class FakePluginWatcher:
    """The kubelet plugin watcher for one plugins_registry directory: GetInfo, connect, NotifyRegistrationStatus."""

    def __init__(self, registry_dir: Path, accept: bool = True) -> None:
        self.registry_dir = registry_dir
        self.accept = accept
        self.infos: dict[Path, reg_pb.PluginInfo] = {}
        self.connections: list[Connection] = []
        self._known: dict[Path, tuple[int, int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def _register(self, socket: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            registration = reg_grpc.RegistrationStub(channel)
            info = await registration.GetInfo(reg_pb.InfoRequest(), timeout=1)
            self.infos[socket] = info
            if not self.accept:
                status = reg_pb.RegistrationStatus(plugin_registered=False, error="RegisterPlugin error -- rejected")
                await registration.NotifyRegistrationStatus(status, timeout=5)
                return
            endpoint = Path(info.endpoint) if info.endpoint else socket
            self.connections.append(await connect(info.name, endpoint))
            await registration.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)

    async def _loop(self) -> None:
        # A test stand-in may poll; the real watcher is the agent's.
        while True:
            for entry in self.registry_dir.iterdir():
                if entry.name.startswith(".") or not entry.is_socket():
                    continue
                # A socket created anew may get the inode number back: its time tells it apart, as the kubelet's
                # watcher tells it by the creation event.
                info = entry.stat()
                inode = (info.st_ino, info.st_mtime_ns)
                if self._known.get(entry) != inode:
                    # Like the kubelet's reconciler: a failed registration is retried on the next round.
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self._register(entry)
                        self._known[entry] = inode
            await asyncio.sleep(0.05)

    def start(self) -> FakePluginWatcher:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for connection in self.connections:
            await connection.close()


# --------------------------------------------------------------------------------------------------------------
# Reference plugins as processes


class PluginProcess:
    """`python -m deviceplane plugin <kind> ...` with its output in files (no pipe can fill up and block it)."""

    def __init__(self, workdir: Path, kind: str, *args: str) -> None:
        self.kind = kind
        workdir.mkdir(parents=True, exist_ok=True)
        stamp = f"{kind}-{time.monotonic_ns()}"
        self.stdout_path = workdir / f"{stamp}.out"
        self.stderr_path = workdir / f"{stamp}.err"
        cmd = [sys.executable, "-m", "deviceplane", "plugin", kind, *args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env(), cwd=ROOT)
        self._control: str | None = None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def control_url(self, timeout: float = 15.0) -> str:
        """The sim's control endpoint, as it printed it (blocking wait; the plugin is another process)."""
        deadline = time.monotonic() + timeout
        while self._control is None:
            for line in self.stdout.splitlines():
                if line.startswith("control: "):
                    self._control = line.removeprefix("control: ").strip()
            if self._control is None:
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.kind} exited with {self.proc.returncode}: {self.stderr}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.kind} printed no control address: {self.stderr}")
                time.sleep(0.02)
        return self._control

    def control(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.control_url() + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{method} {path}: {err.code} {err.read().decode()}") from None
        return json.loads(text) if text.startswith(("{", "[")) else text

    def kill(self) -> None:
        """SIGKILL if still running, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.kind} did not stop on signal {sig} within {timeout}s") from None
        return self.proc.returncode


def run_plugin_cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run `deviceplane plugin ...` to completion (bad-input cases)."""
    return subprocess.run(
        [sys.executable, "-m", "deviceplane", "plugin", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=ROOT,
    )
