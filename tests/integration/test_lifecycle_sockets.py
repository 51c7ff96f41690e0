"""The agent's sockets removed while it runs (a clean-up script, an operator's `rm`): each is served again, so its
clients reconnect by path as after a restart. The kubelet re-creates neither (its kubelet.sock and PodResources
listeners keep serving a path that is gone); deviceplane does, and says so in docs/agent.md. Something else put in a
socket's place (a regular file, another process's socket) is left alone, for PodResources as for kubelet.sock."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from deviceplane.api.podresources.v1 import api_pb2 as pr
from deviceplane.api.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplane.unix_sockets import SOCKET_CHECK_INTERVAL_SECONDS
from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/gpu"
RECREATIONS = 20


def pod_resources_socket(agent: AgentProcess) -> Path:
    return agent.workdir / "pod-resources" / "kubelet.sock"


def allocatable_ids(socket_path: Path) -> list[str]:
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        return allocatable_on(channel) or []


def allocatable_on(channel: grpc.Channel) -> list[str] | None:
    """None while the channel cannot reach a server (it dials the path again by itself)."""
    try:
        answer = pr_grpc.PodResourcesListerStub(channel).GetAllocatableResources(
            pr.AllocatableResourcesRequest(), timeout=5
        )
    except grpc.RpcError:
        return None
    return sorted(i for d in answer.devices for i in d.device_ids)


def served_again_logged(agent: AgentProcess) -> int:
    entries = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
    return sum(
        e.get("msg") == "pod resources socket disappeared; serving again" and e.get("level") == "warning"
        for e in entries
    )


@pytest.fixture
def served(agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]) -> Path:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["gpu0", "Healthy"]])
    assert plugin.register(R)["ok"]
    socket_path = pod_resources_socket(agent)
    wait_for(lambda: allocatable_ids(socket_path) == ["gpu0"], what="PodResources answers")
    return socket_path


def test_a_removed_pod_resources_socket_is_served_again(agent: AgentProcess, served: Path) -> None:
    socket_path = served
    with grpc.insecure_channel(f"unix://{socket_path}") as kept:  # a client that dials by path, as dcgm-exporter
        assert allocatable_on(kept) == ["gpu0"]
        socket_path.unlink()
        wait_for(socket_path.exists, timeout=5, what="PodResources socket served again")
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        assert allocatable_ids(socket_path) == ["gpu0"]
        # the client's channel reaches the new socket by itself (gRPC reconnects with backoff: 1 s, then 1.6 s)
        wait_for(lambda: allocatable_on(kept) == ["gpu0"], timeout=10, what="the kept channel answered again")
    assert agent.get_text("/readyz") == "ok"
    assert served_again_logged(agent) == 1
    assert agent.metric("deviceplane_agent_task_restarts_total", task="pod-resources-socket") == 0.0


def test_a_file_in_the_sockets_place_is_left_alone(agent: AgentProcess, served: Path) -> None:
    """As for kubelet.sock: only a path with nothing at it is served again; what someone put there is not ours to
    remove (and grpc cannot bind over a regular file). Once it is removed, the socket is served again."""
    socket_path = served
    socket_path.unlink()
    socket_path.write_text("not a socket\n")  # before the next check, most likely; either way it must stay
    time.sleep(3 * SOCKET_CHECK_INTERVAL_SECONDS)
    assert socket_path.read_text() == "not a socket\n" and stat.S_ISREG(socket_path.stat().st_mode)
    assert agent.get_text("/readyz") == "ok"
    socket_path.unlink()
    wait_for(socket_path.exists, timeout=5, what="PodResources socket served again")
    assert allocatable_ids(socket_path) == ["gpu0"]


def test_another_socket_in_the_sockets_place_is_left_alone(agent: AgentProcess, served: Path) -> None:
    """Another process's socket at the path (a second agent, a stand-in) keeps it: the agent does not bind over it
    (grpc would unlink it to bind). Once it is removed, ours is served again."""
    socket_path = served
    socket_path.unlink()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(socket_path))
        other.listen()
        inode = os.stat(socket_path).st_ino
        time.sleep(3 * SOCKET_CHECK_INTERVAL_SECONDS)
        assert os.stat(socket_path).st_ino == inode, "the other process's socket was replaced"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(socket_path))
            accepted, _ = other.accept()  # still the other process's listener
            accepted.close()
        assert agent.get_text("/readyz") == "ok"
    finally:
        other.close()
    socket_path.unlink()
    wait_for(socket_path.exists, timeout=5, what="PodResources socket served again")
    assert allocatable_ids(socket_path) == ["gpu0"]


def test_re_creations_leak_no_fds_or_threads(agent: AgentProcess, served: Path) -> None:
    socket_path = served
    assert agent.proc is not None
    threads = Path(f"/proc/{agent.proc.pid}/task")

    def recreate() -> None:
        socket_path.unlink()  # (the new socket may get the old inode number: it cannot tell them apart)
        wait_for(socket_path.exists, timeout=5, what="PodResources socket served again")
        assert allocatable_ids(socket_path) == ["gpu0"]  # a connection to the new server, opened and closed

    recreate()  # the first re-creation may set up what every later one reuses
    fds, tasks = agent.open_fds(), len(list(threads.iterdir()))
    for _ in range(RECREATIONS):
        recreate()
    # what the last client and server left may take a moment to close
    after = wait_for(lambda: (n := agent.open_fds()) <= fds + 1 and n, timeout=5, what=f"fds back to ~{fds}")
    print(f"[figure] agent fds: {fds} after 1 re-creation, {after} after {RECREATIONS} more; threads {tasks} -> "
          f"{len(list(threads.iterdir()))}")  # fmt: skip
    assert len(list(threads.iterdir())) <= tasks + 1
    assert served_again_logged(agent) == RECREATIONS + 1
    assert agent.get_text("/readyz") == "ok"
    time.sleep(2 * SOCKET_CHECK_INTERVAL_SECONDS)  # the last server's socket stays (no late unlink by an old server)
    assert stat.S_ISSOCK(socket_path.stat().st_mode) and allocatable_ids(socket_path) == ["gpu0"]
