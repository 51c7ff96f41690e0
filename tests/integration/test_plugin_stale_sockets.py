"""A plugin killed with SIGKILL (or by the OOM killer) leaves its socket behind, and each new instance takes a name
of its own: they piled up. A starting plugin removes its resource's sockets that nobody serves - never a live one,
never another resource's. Real sim processes, really SIGKILLed."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

from tests.support.plugins import PluginProcess, wait_until


def sockets(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_socket()}


async def started(tmp: Path, resource: str, started_: list[PluginProcess]) -> tuple[PluginProcess, str]:
    """A sim for `resource` serving in tmp/dp, and its socket's name."""
    before = sockets(tmp / "dp") if (tmp / "dp").exists() else set()
    proc = PluginProcess(tmp, "sim", "--plugin-dir", str(tmp / "dp"), "--resource", resource, "--count", "1")
    started_.append(proc)
    await wait_until(lambda: "serving DevicePlugin on" in proc.stderr, within=15, what=f"{resource} serving")
    (name,) = sockets(tmp / "dp") - before
    return proc, name


async def test_a_starting_plugin_removes_its_resources_dead_sockets_only(short_tmp: Path) -> None:
    started_: list[PluginProcess] = []
    try:
        killed = []
        for _ in range(3):
            proc, name = await started(short_tmp, "example.com/crash", started_)
            killed.append((proc, name))
        live, live_name = await started(short_tmp, "example.com/crash", started_)  # a surge rollout's other one
        other, other_name = await started(short_tmp, "example.com/crash-1", started_)  # its name starts the same
        for proc, _ in [*killed, (other, other_name)]:
            proc.stop(signal.SIGKILL)
        dp = short_tmp / "dp"
        stale = {name for _, name in killed}
        assert stale | {live_name, other_name} <= sockets(dp)  # SIGKILL removes nothing
        # Not a socket, though named like one; and a socket of this resource someone listens on outside the SDK.
        (dp / "example.com_crash-1-0badf00d.sock").write_text("")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(dp / "example.com_crash-2-feedbeef.sock"))
        listener.listen()

        new, new_name = await started(short_tmp, "example.com/crash", started_)
        left = sockets(dp)
        assert not stale & left, left
        assert {live_name, other_name, new_name, "example.com_crash-2-feedbeef.sock"} <= left
        assert (dp / "example.com_crash-1-0badf00d.sock").is_file()
        for name in stale:
            assert f"removed {dp / name}: a stale socket" in new.stderr
        assert live.proc.poll() is None and "removed" not in live.stderr
        listener.close()
    finally:
        for proc in started_:
            proc.kill()
