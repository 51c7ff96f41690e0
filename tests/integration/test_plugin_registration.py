"""Registration both ways and staying registered, with the sim plugin as a real process and a kubelet stand-in."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.support.plugins import FakeKubelet, FakePluginWatcher, PluginProcess, wait_until
from tests.support.procs import ROOT, child_env


@pytest.fixture
async def kubelet(short_tmp: Path) -> AsyncIterator[FakeKubelet]:
    fake = await FakeKubelet(short_tmp / "dp").start()
    yield fake
    await fake.stop()


@pytest.fixture
def processes() -> AsyncIterator[list[PluginProcess]]:
    started: list[PluginProcess] = []
    yield started  # type: ignore[misc]
    for proc in started:
        proc.kill()


def sim(processes: list[PluginProcess], tmp: Path, *args: str) -> PluginProcess:
    proc = PluginProcess(tmp, "sim", "--plugin-dir", str(tmp / "dp"), "--control", "127.0.0.1:0", *args)
    processes.append(proc)
    return proc


def plugin_sockets(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_socket() and p.name != "kubelet.sock")


async def test_registers_with_kubelet_sock_after_serving(short_tmp, kubelet, processes):
    proc = sim(processes, short_tmp, "--count", "4", "--numa", "2")
    connection = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    request = kubelet.requests[-1]
    assert request.version == "v1beta1"
    # Relative endpoint: a bare file name next to kubelet.sock, and the plugin was already serving on it.
    assert "/" not in request.endpoint and (short_tmp / "dp" / request.endpoint).is_socket()
    assert re.fullmatch(rf"example\.com_sim-{proc.proc.pid}-[0-9a-f]{{8}}\.sock", request.endpoint), request.endpoint
    assert connection.options == pb.DevicePluginOptions(
        pre_start_required=True, get_preferred_allocation_available=True
    )
    assert request.options == connection.options
    snapshot = await wait_until(lambda: connection.latest, what="first snapshot")
    assert snapshot == {
        "sim-0": ("Healthy", (0,)),
        "sim-1": ("Healthy", (0,)),
        "sim-2": ("Healthy", (1,)),
        "sim-3": ("Healthy", (1,)),
    }
    assert proc.stop() == 0
    assert plugin_sockets(short_tmp / "dp") == []  # clean shutdown removes its socket


async def test_options_follow_hooks(short_tmp, kubelet, processes):
    sim(processes, short_tmp, "--no-pre-start", "--no-preferred-allocation")
    connection = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    assert connection.options == pb.DevicePluginOptions()


async def test_registers_through_plugins_registry(short_tmp, processes):
    registry = short_tmp / "plugins_registry"
    watcher = FakePluginWatcher(registry).start()
    try:
        proc = PluginProcess(short_tmp, "sim", "--registry-dir", str(registry), "--plugin-dir", str(short_tmp / "dp"),
                             "--count", "2", "--control", "127.0.0.1:0")  # fmt: skip
        processes.append(proc)
        connection = await wait_until(lambda: watcher.connections and watcher.connections[-1], what="watcher")
        info = next(iter(watcher.infos.values()))
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
            "DevicePlugin", "example.com/sim", "", ["v1beta1"]
        )  # fmt: skip
        # The socket lives in the registry dir; nothing goes to the device-plugin dir in this mode.
        assert connection.socket.parent == registry
        assert not (short_tmp / "dp").exists() or plugin_sockets(short_tmp / "dp") == []
        assert await wait_until(lambda: connection.latest, what="snapshot") == {
            "sim-0": ("Healthy", (0,)),
            "sim-1": ("Healthy", (0,)),
        }
        # NotifyRegistrationStatus reached the plugin: it counts the registration.
        await wait_until(lambda: proc.control("GET", "/devices")["registrations"] == 1, what="status notified")
        assert proc.stop() == 0
        assert plugin_sockets(registry) == []
    finally:
        await watcher.stop()


async def test_rejected_plugin_watcher_registration_is_logged(short_tmp, processes):
    registry = short_tmp / "plugins_registry"
    watcher = FakePluginWatcher(registry, accept=False).start()
    try:
        proc = PluginProcess(short_tmp, "sim", "--registry-dir", str(registry), "--control", "127.0.0.1:0")
        processes.append(proc)
        await wait_until(lambda: "registration rejected: RegisterPlugin error -- rejected" in proc.stderr, what="log")
        assert proc.control("GET", "/devices")["registrations"] == 0
    finally:
        await watcher.stop()


async def test_waits_for_kubelet_sock_then_registers(short_tmp, processes):
    proc = sim(processes, short_tmp)
    await wait_until(lambda: "does not exist (yet)" in proc.stderr, what="first failed attempt")
    await asyncio.sleep(1.5)  # let the retry backoff grow: registration must still be prompt once kubelet appears
    fake = await FakeKubelet(short_tmp / "dp").start()
    try:
        started = time.monotonic()
        await wait_until(lambda: fake.latest("example.com/sim"), within=2, what="registration")
        assert time.monotonic() - started < 2
        # One line per distinct problem, not one per retry (a second kind of failure may show while the stand-in
        # binds kubelet.sock before it serves).
        assert proc.stderr.count("registration failed") <= 2, proc.stderr
    finally:
        await fake.stop()


async def kubelet_restart(tmp: Path, old: FakeKubelet) -> FakeKubelet:
    """What a restarting kubelet does: stop, delete every socket in its directory, listen again (spec §4.2)."""
    await old.stop()
    for entry in (tmp / "dp").iterdir():
        if entry.is_socket():
            entry.unlink()
    return await FakeKubelet(tmp / "dp").start()


async def test_reregisters_within_2s_after_kubelet_restart(short_tmp, kubelet, processes):
    proc = sim(processes, short_tmp)
    await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    fake = kubelet
    for _ in range(3):
        fake = await kubelet_restart(short_tmp, fake)
        started = time.monotonic()
        connection = await wait_until(lambda f=fake: f.latest("example.com/sim"), within=2, what="re-registration")
        assert time.monotonic() - started < 2
        await wait_until(lambda c=connection: c.latest, within=2, what="snapshot after re-registration")
        assert connection.socket.is_socket()  # the plugin serves again on a fresh socket
    await fake.stop()
    assert proc.proc.poll() is None


async def test_reregisters_within_2s_when_kubelet_sock_recreated(short_tmp, kubelet, processes):
    """Only kubelet.sock goes away and comes back; the plugin's own socket is untouched."""
    sim(processes, short_tmp)
    first = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    await kubelet.stop()
    (short_tmp / "dp" / "kubelet.sock").unlink(missing_ok=True)
    await asyncio.sleep(0.3)
    fake = await FakeKubelet(short_tmp / "dp").start()
    try:
        started = time.monotonic()
        again = await wait_until(lambda: fake.latest("example.com/sim"), within=2, what="re-registration")
        assert time.monotonic() - started < 2
        assert again.socket == first.socket
    finally:
        await fake.stop()


async def test_serves_again_when_its_socket_is_deleted(short_tmp, kubelet, processes):
    sim(processes, short_tmp)
    first = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    first.socket.unlink()
    started = time.monotonic()
    await wait_until(lambda: len(kubelet.connections) == 2, within=2, what="re-registration")
    assert time.monotonic() - started < 2
    assert first.socket.is_socket()
    second = kubelet.connections[-1]
    assert await wait_until(lambda: second.latest, what="snapshot")


async def test_no_fd_leak_across_restarts(short_tmp, kubelet, processes):
    proc = sim(processes, short_tmp)
    await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    fake = await kubelet_restart(short_tmp, kubelet)  # warm-up: first restart allocates lazily-created things
    await wait_until(lambda: fake.latest("example.com/sim"), what="registration")
    before = len(os.listdir(f"/proc/{proc.proc.pid}/fd"))
    for _ in range(8):
        fake = await kubelet_restart(short_tmp, fake)
        await wait_until(lambda f=fake: f.latest("example.com/sim") and f.latest("example.com/sim").latest,
                         what="re-registration")  # fmt: skip
    await asyncio.sleep(0.5)
    after = len(os.listdir(f"/proc/{proc.proc.pid}/fd"))
    await fake.stop()
    assert after <= before + 2, (before, after)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_cleanly_and_removes_socket(short_tmp, kubelet, processes, sig):
    proc = sim(processes, short_tmp)
    connection = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    await wait_until(lambda: connection.latest, what="stream open")
    assert proc.stop(sig, timeout=5) == 0
    assert not connection.socket.exists()
    await wait_until(lambda: connection.stream_ended, within=2, what="stream ended")
    assert "Traceback" not in proc.stderr


async def test_allocate_on_removed_device_is_an_error(short_tmp, kubelet, processes):
    sim(processes, short_tmp, "--count", "1")
    connection = await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["sim-7"])])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await connection.stub.Allocate(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "invalid allocation request with non-existing device sim-7"


async def test_survives_its_directory_being_removed_and_recreated(short_tmp, kubelet, processes):
    proc = sim(processes, short_tmp)
    await wait_until(lambda: kubelet.latest("example.com/sim"), what="registration")
    await kubelet.stop()
    shutil.rmtree(short_tmp / "dp")
    await asyncio.sleep(0.5)
    fake = await FakeKubelet(short_tmp / "dp").start()  # re-creates the directory, like a kubelet starting up
    try:
        connection = await wait_until(lambda: fake.latest("example.com/sim"), within=1, what="re-registration")
        assert await wait_until(lambda: connection.latest, what="snapshot")
        assert proc.proc.poll() is None
    finally:
        await fake.stop()


def can_make_pid_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(not can_make_pid_namespaces(), reason="needs unshare and the right to create pid namespaces")
async def test_two_pid1_plugins_of_one_resource_do_not_fight(short_tmp, kubelet):
    """Two plugin containers of one resource on a node (a DaemonSet surge rollout): both processes are pid 1. The
    socket was named `<resource>-<pid>.sock`, so they deleted each other's socket and re-registered ~3 times a second
    forever, cutting the kubelet's stream each time. Each instance has a name of its own now."""
    cmd = ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m", "deviceplane", "plugin", "sim"]
    cmd += ["--plugin-dir", str(short_tmp / "dp"), "--count", "2"]
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(
            subprocess.Popen(
                cmd,
                env=child_env(),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # unshare forks: the whole group is killed at the end
            )
        )

    try:
        start()
        await wait_until(lambda: len(kubelet.requests) == 1, within=15, what="first registration")
        start()
        await wait_until(lambda: len(kubelet.requests) == 2, within=15, what="second registration")
        await asyncio.sleep(3)  # past the plugins' 2 s safety tick: any fight would show as more registrations
        assert len(kubelet.requests) == 2, [r.endpoint for r in kubelet.requests]
        endpoints = [r.endpoint for r in kubelet.requests]
        assert len(set(endpoints)) == 2 and all(e.startswith("example.com_sim-1-") for e in endpoints), endpoints
        assert all((short_tmp / "dp" / e).is_socket() for e in endpoints)
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
