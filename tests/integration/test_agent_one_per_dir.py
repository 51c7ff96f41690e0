"""A plugin directory is served by one agent at a time, and an agent that cannot start leaves the directory as it
found it (found in review: a second agent removed the running one's plugin sockets and bound kubelet.sock over its
socket, gRPC raising nothing; a bind failure ended start-up with a traceback and a dead kubelet.sock)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/res"
TWO = [["Dev1", "Healthy"], ["Dev2", "Healthy"]]


def serving_agent_with_plugin(
    agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> tuple[AgentProcess, int]:
    first = agent_factory()
    plugin = plugin_factory(first.plugin_dir, "p.sock", TWO)
    assert plugin.register(R)["ok"]
    wait_for(lambda: first.counts(R) == (2, 2))
    return first, os.stat(first.plugin_dir / "kubelet.sock").st_ino


def assert_untouched(first: AgentProcess, inode: int) -> None:
    assert (first.plugin_dir / "p.sock").is_socket(), "the running agent's plugin socket was removed"
    assert os.stat(first.plugin_dir / "kubelet.sock").st_ino == inode, "kubelet.sock was replaced"
    assert first.counts(R) == (2, 2)


def test_a_second_agent_on_the_same_directory_is_refused_and_touches_nothing(
    short_tmp: Path, agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    first, inode = serving_agent_with_plugin(agent_factory, plugin_factory)
    second = agent_factory(wait=False, workdir=short_tmp / "second")  # the same <short_tmp>/dp
    assert second.proc is not None and second.proc.wait(30) == 1
    log = second.log()
    assert f"another deviceplane agent (pid {first.proc.pid if first.proc else '?'}) is serving" in log, log[-1500:]
    assert "Traceback" not in log, log[-1500:]
    assert_untouched(first, inode)


def test_a_second_agent_that_fails_later_in_start_leaves_the_first_alone(
    short_tmp: Path, agent_factory: Callable[..., AgentProcess], plugin_factory: Callable[..., TestPlugin]
) -> None:
    first, inode = serving_agent_with_plugin(agent_factory, plugin_factory)
    second = AgentProcess(short_tmp / "second", plugin_dir=first.plugin_dir)
    second.port, second.url = first.port, first.url  # its HTTP port is taken too
    try:
        second.start(wait=False)
        assert second.proc is not None and second.proc.wait(30) == 1
    finally:
        second.kill()
    assert_untouched(first, inode)


def test_the_directory_is_free_again_once_the_agent_is_gone(
    short_tmp: Path, agent_factory: Callable[..., AgentProcess]
) -> None:
    first = agent_factory()
    first.kill()  # SIGKILL: the kernel drops the lock with the process
    again = agent_factory(workdir=short_tmp / "again")
    assert again.healthy()


def test_a_socket_that_cannot_be_bound_fails_start_cleanly(
    short_tmp: Path, agent_factory: Callable[..., AgentProcess]
) -> None:
    too_long = short_tmp / ("x" * 110) / "kubelet.sock"  # over a unix socket address's 108 bytes
    agent = agent_factory("--pod-resources-socket", str(too_long), wait=False)
    assert agent.proc is not None and agent.proc.wait(30) == 1
    log = agent.log()
    assert "agent failed to start: cannot serve" in log, log[-1500:]
    assert "Traceback" not in log, log[-1500:]
    assert not (agent.plugin_dir / "kubelet.sock").exists(), "a dead registration socket was left for plugins"
