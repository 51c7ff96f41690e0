"""The `files` reference plugin as a real process: live directory, allocation, odd files, 10,000 files."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deviceplane.api.deviceplugin.v1beta1 import api_pb2 as pb
from tests.support.plugins import FakeKubelet, PluginProcess, short_tmpdir, wait_until


@pytest.fixture
async def setup() -> AsyncIterator[tuple[Path, FakeKubelet, list[PluginProcess]]]:
    with short_tmpdir() as tmp:
        (tmp / "cola").mkdir()
        kubelet = await FakeKubelet(tmp / "dp").start()
        started: list[PluginProcess] = []
        try:
            yield tmp, kubelet, started
        finally:
            for proc in started:
                proc.kill()
            await kubelet.stop()


def start_files(tmp: Path, started: list[PluginProcess], *args: str) -> PluginProcess:
    proc = PluginProcess(tmp, "files", "--plugin-dir", str(tmp / "dp"), "--dir", str(tmp / "cola"), *args)
    started.append(proc)
    return proc


async def registered(kubelet: FakeKubelet, resource: str = "example.com/cola"):
    connection = await wait_until(lambda: kubelet.latest(resource), within=15, what="registration")
    await wait_until(lambda: connection.latest is not None, what="first snapshot")
    return connection


async def test_files_are_devices_and_changes_arrive_within_1s(setup):
    tmp, kubelet, started = setup
    cola = tmp / "cola"
    for name in ("a", "b"):
        (cola / name).write_text(name)
    start_files(tmp, started)
    connection = await registered(kubelet)
    assert connection.latest == {"a": ("Healthy", ()), "b": ("Healthy", ())}

    t0 = time.monotonic()
    (cola / "c").write_text("c")
    await wait_until(lambda: set(connection.latest) == {"a", "b", "c"}, within=1, what="created file")
    created_after = time.monotonic() - t0

    t0 = time.monotonic()
    (cola / "a").unlink()
    await wait_until(lambda: set(connection.latest) == {"b", "c"}, within=1, what="removed file")
    removed_after = time.monotonic() - t0
    assert created_after < 1 and removed_after < 1

    (cola / "b").rename(cola / "b2")
    await wait_until(lambda: set(connection.latest) == {"b2", "c"}, within=1, what="renamed file")


async def test_allocate_returns_env_and_read_only_mounts(setup):
    tmp, kubelet, started = setup
    for name in ("x", "y", "z"):
        (tmp / "cola" / name).write_text(name)
    start_files(tmp, started)
    connection = await registered(kubelet)
    request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["z", "x"])])
    (part,) = (await connection.stub.Allocate(request, timeout=5)).container_responses
    assert dict(part.envs) == {"COLA_DEVICES": "z,x"}
    assert [(m.container_path, m.host_path, m.read_only) for m in part.mounts] == [
        ("/var/run/cola/z", str(tmp / "cola" / "z"), True),
        ("/var/run/cola/x", str(tmp / "cola" / "x"), True),
    ]
    assert connection.options == pb.DevicePluginOptions()


async def test_only_regular_visible_files_count(setup):
    tmp, kubelet, started = setup
    cola = tmp / "cola"
    (cola / "real").write_text("")
    (cola / ".hidden").write_text("")
    (cola / "subdir").mkdir()
    (cola / "link").symlink_to(cola / "real")
    (cola / "dangling").symlink_to(cola / "missing")
    os.mkfifo(cola / "fifo")
    locked = cola / "locked"
    locked.write_text("secret")
    locked.chmod(0)
    start_files(tmp, started)
    connection = await registered(kubelet)
    # Unreadable files are still devices (the runtime mounts them as root); see the files module docstring.
    assert set(connection.latest) == {"real", "link", "locked"}


async def test_unreadable_file_is_reported_when_not_root(setup):
    if os.geteuid() == 0:
        pytest.skip("root can read every file; covered for non-root users only")
    tmp, kubelet, started = setup
    locked = tmp / "cola" / "locked"
    locked.write_text("")
    locked.chmod(0)
    proc = start_files(tmp, started)
    await registered(kubelet)
    assert "is not readable by the plugin; it is still offered as a device" in proc.stderr


async def test_ten_thousand_files(setup):
    tmp, kubelet, started = setup
    cola = tmp / "cola"
    for i in range(10_000):
        (cola / f"dev{i:05d}").touch()
    start_files(tmp, started)
    connection = await registered(kubelet)
    assert len(connection.latest) == 10_000
    (cola / "dev10000").touch()
    await wait_until(lambda: len(connection.latest) == 10_001, within=1, what="10,001st file")
    for i in range(0, 10_000, 2):
        (cola / f"dev{i:05d}").unlink()
    await wait_until(lambda: len(connection.latest) == 5_001, within=3, what="5,000 removals")


async def test_directory_removed_and_recreated(setup):
    tmp, kubelet, started = setup
    cola = tmp / "cola"
    (cola / "a").touch()
    start_files(tmp, started)
    connection = await registered(kubelet)
    (cola / "a").unlink()
    cola.rmdir()
    await wait_until(lambda: connection.latest == {}, within=2, what="no devices without the directory")
    cola.mkdir()
    (cola / "b").touch()
    await wait_until(lambda: connection.latest == {"b": ("Healthy", ())}, within=2, what="directory back")


def write_non_utf8_file(directory: Path) -> None:
    """A file named b"caf\\xe9": Latin-1 "café", as an older tool may write it - not valid UTF-8."""
    with open(os.path.join(os.fsencode(directory), b"caf\xe9"), "w") as file:
        file.write("x")


async def test_non_utf8_name_present_at_start_is_skipped(setup):
    """Device ids are protobuf strings: such a name made the plugin exit at start. It is skipped with a warning and
    the other files are served."""
    tmp, kubelet, started = setup
    (tmp / "cola" / "a").write_text("a")
    write_non_utf8_file(tmp / "cola")
    proc = start_files(tmp, started)
    connection = await registered(kubelet)
    assert connection.latest == {"a": ("Healthy", ())}
    assert proc.proc.poll() is None
    assert "caf\\xe9" in proc.stderr and "not valid UTF-8" in proc.stderr


async def test_non_utf8_name_appearing_later_does_not_stop_updates(setup):
    """Created while the plugin runs, such a name ended its directory watch: no update was sent after it. Later
    changes still arrive, and the warning is given once however many rescans see the file."""
    tmp, kubelet, started = setup
    cola = tmp / "cola"
    (cola / "a").write_text("a")
    proc = start_files(tmp, started)
    connection = await registered(kubelet)
    write_non_utf8_file(cola)
    (cola / "b").write_text("b")
    await wait_until(lambda: set(connection.latest) == {"a", "b"}, within=5, what="a change after the odd name")
    (cola / "c").write_text("c")
    await wait_until(lambda: set(connection.latest) == {"a", "b", "c"}, within=5, what="a second change")
    assert proc.stderr.count("not valid UTF-8") == 1, proc.stderr
