"""A plugin whose ListAndWatch stream the kubelet ends, while the plugin keeps running, registers again: the kubelet
never dials a plugin back by itself. The sim as a real process; the kubelet stand-in ends streams on cue (the real
kubelet doing it in a surge rollout is tests/e2e/test_plugin_sdk_kubelet.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.support.plugins import FakeKubelet, FakePluginWatcher, PluginProcess, connect, wait_until


async def test_registers_again_when_the_kubelet_ends_its_stream(short_tmp: Path) -> None:
    kubelet = await FakeKubelet(short_tmp / "dp").start()
    proc = PluginProcess(short_tmp, "sim", "--plugin-dir", str(short_tmp / "dp"), "--count", "2")
    try:
        first = await wait_until(lambda: kubelet.latest("example.com/sim"), within=15, what="registration")
        await wait_until(lambda: first.latest, what="first snapshot")

        # Another client's stream (a debugging tool) coming and going changes nothing: the kubelet's is open.
        other = await connect("example.com/sim", first.socket)
        await wait_until(lambda: other.latest, what="the other client's snapshot")
        await other.close()
        await asyncio.sleep(2)
        assert len(kubelet.requests) == 1

        await first.close()  # the kubelet drops the plugin
        ended = time.monotonic()
        second = await wait_until(lambda: len(kubelet.connections) == 2 and kubelet.connections[1], what="again")
        assert 0.9 < time.monotonic() - ended < 3  # after a short wait for a new stream, not at once
        assert await wait_until(lambda: second.latest, what="snapshot") == first.latest
        assert "the kubelet ended the ListAndWatch stream and opened no new one within 1 s" in proc.stderr

        await second.close()  # dropped again: the wait doubles
        ended = time.monotonic()
        await wait_until(lambda: len(kubelet.connections) == 3, within=5, what="registered a third time")
        assert 1.9 < time.monotonic() - ended < 4
        assert proc.stderr.count("registering again") == 2
    finally:
        proc.kill()
        await kubelet.stop()


async def test_serves_anew_for_the_plugin_watcher_when_its_stream_ends(short_tmp: Path) -> None:
    """Through plugins_registry the plugin cannot call Register: the watcher registers a socket when it appears, so
    the plugin serves a new one at its path. (The kubelet harness has no plugin watcher: the stand-in, which
    registers a socket created anew, as the kubelet's does.)"""
    registry = short_tmp / "plugins_registry"
    watcher = FakePluginWatcher(registry).start()
    proc = PluginProcess(short_tmp, "sim", "--registry-dir", str(registry), "--count", "2", "--control", "127.0.0.1:0")
    try:
        first = await wait_until(lambda: watcher.connections and watcher.connections[-1], within=15, what="watcher")
        await wait_until(lambda: first.latest, what="first snapshot")
        created = first.socket.stat().st_mtime_ns
        await first.close()
        second = await wait_until(lambda: len(watcher.connections) == 2 and watcher.connections[1], what="again")
        assert second.socket == first.socket and second.socket.stat().st_mtime_ns != created
        assert await wait_until(lambda: second.latest, what="snapshot") == first.latest
        await wait_until(lambda: proc.control("GET", "/devices")["registrations"] == 2, what="status notified")
    finally:
        proc.kill()
        await watcher.stop()
