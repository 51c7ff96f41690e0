"""File names that are not UTF-8 (Linux names are bytes; a tool or a plugin in another language can make them) in the
plugin directory and the plugins registry directory: nothing fails, stalls or restarts because of them (found in
review: one such socket in the registry directory crashed the plugin watcher's directory watch on every event that
named it, and its registration attempt raised unseen, again every second)."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/probe"
TWO = [["Dev1", "Healthy"], ["Dev2", "Healthy"]]
NOT_UTF8 = b"gpu-\xff.sock"


@pytest.fixture
def registry_dir(short_tmp: Path) -> Path:
    return short_tmp / "reg"


def listening_socket(path: bytes) -> socket.socket:
    """A real unix socket that accepts connections and never speaks gRPC: what a plugin in another language that
    names its socket in another encoding would look like to us."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(4)
    return sock


@pytest.fixture
def odd_socket(registry_dir: Path) -> Iterator[socket.socket]:
    registry_dir.mkdir(parents=True)
    sock = listening_socket(os.fsencode(registry_dir) + b"/" + NOT_UTF8)
    yield sock
    sock.close()


def test_a_registry_socket_named_in_another_encoding_breaks_nothing(
    agent_factory: Callable[..., AgentProcess],
    registry_dir: Path,
    odd_socket: socket.socket,
    plugin_factory: Callable[..., TestPlugin],
) -> None:
    agent = agent_factory("--plugins-registry-dir", str(registry_dir), "--plugin-dial-timeout", "1s")
    os.utime(os.fsencode(registry_dir) + b"/" + NOT_UTF8)  # an event naming it, as a plugin's chmod or touch gives
    plugin_factory(registry_dir, "p.sock", TWO, "--watcher-info", json.dumps({"name": R}))
    wait_for(lambda: agent.counts(R) == (2, 2), what="the other plugin registered")
    time.sleep(2.5)  # two reconcile passes, and the supervisor's first backoff
    assert agent.metric("deviceplane_agent_task_restarts_total", task="plugin-watcher") == 0.0, agent.log()[-3000:]
    assert agent.get_text("/readyz") == "ok"
    log = agent.log()
    assert "Task exception was never retrieved" not in log, log[-3000:]
    assert log.count("plugin socket ignored: its path is not UTF-8") == 1, log[-3000:]  # once, not every second
    assert "plugin registry watch broke; watching again" in log, log[-3000:]  # the event did reach the watch


def test_a_stale_plugin_socket_named_in_another_encoding_is_removed_at_start(
    short_tmp: Path, agent_factory: Callable[..., AgentProcess]
) -> None:
    plugin_dir = short_tmp / "dp"
    plugin_dir.mkdir()
    stale = os.fsencode(plugin_dir) + b"/" + NOT_UTF8
    listening_socket(stale).close()  # left by a plugin that died
    other = os.fsencode(plugin_dir) + b"/notes-\xfe.txt"
    Path(os.fsdecode(other)).write_text("kept")
    agent = agent_factory()
    assert not os.path.lexists(stale)
    assert os.path.exists(other)
    assert agent.healthy()
    assert "Traceback" not in agent.log(), agent.log()[-3000:]
