"""`--debug-admit-api 127.0.0.1:PORT` (the benchmarking aid of benchmarks/compare.py): off by default, admits
through the normal admission path when on, refuses bad input, and only listens on a loopback address. Its HTTP server
(serving/lean_http.py) is fuzzed with raw bytes in tests/fuzz/test_fuzz_debug_admit.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.alloc_env import AllocEnv, alloc_env
from tests.support.pods import devices_of, pods
from tests.support.procs import AgentProcess, child_env, free_port

RESOURCE = "example.com/sim"


def post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        body = err.read()
        return err.code, dict(json.loads(body)) if body.startswith(b"{") else {}


def pod(name: str, count: int) -> bytes:
    container = {"name": "c", "resources": {"limits": {RESOURCE: str(count)}}}
    return json.dumps({"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {"containers": [container]}}).encode()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def env(short_tmp: Path, port: int) -> Iterator[AllocEnv]:
    with alloc_env(short_tmp, "--debug-admit-api", f"127.0.0.1:{port}") as e:
        e.start_agent()
        e.sim(RESOURCE, 2, 0, "--no-preferred-allocation", "--no-pre-start")
        yield e


def test_admit_and_remove_go_through_admission(env: AllocEnv, port: int) -> None:
    agent = env.agent
    assert agent is not None
    status, answer = post(port, "/debug/v1/admit", pod("a", 2))
    assert status == 200 and answer["admitted"] and answer["state"] == "admitted" and answer["durationNs"] > 0
    view = pods(agent)["a"]
    assert view["source"] == "debug-api:uid-a" and devices_of(view, RESOURCE) == {"sim-0", "sim-1"}
    # the devices are held: a second pod fails with upstream's message
    status, answer = post(port, "/debug/v1/admit", pod("b", 1))
    assert status == 200 and not answer["admitted"] and answer["state"] == "failed"
    assert "requested number of devices unavailable" in answer["reason"]
    status, answer = post(port, "/debug/v1/remove", json.dumps({"uid": "uid-a"}).encode())
    assert status == 200 and answer["removed"] is True
    assert agent.resource(RESOURCE)["allocated"] == 0  # type: ignore[index]
    # the release is journaled before the answer: it survives a kill at once
    env.restart_agent(kill=True)
    env.wait_devices(RESOURCE, 2)
    assert env.agent is not None and env.agent.resource(RESOURCE)["allocated"] == 0  # type: ignore[index]


def test_bad_input_is_refused_and_changes_nothing(env: AllocEnv, port: int) -> None:
    agent = env.agent
    assert agent is not None
    for body in (b"{not json", b"[]", json.dumps({"metadata": {"name": "x"}}).encode(), b"[" * 100_000):
        status, answer = post(port, "/debug/v1/admit", body)
        assert status == 400 and answer["error"], body[:20]
    status, answer = post(port, "/debug/v1/remove", b'{"uid": 3}')
    assert status == 400
    status, answer = post(port, "/debug/v1/admit", b"x" * (1 << 20 + 1))
    assert status == 413 and "body larger than" in answer["error"]
    status, answer = post(port, "/debug/v1/nothing", b"{}")
    assert status == 404
    status, answer = post(port, "/debug/v1/remove", json.dumps({"uid": "nobody"}).encode())
    assert status == 200 and answer["removed"] is False
    assert agent.resource(RESOURCE)["allocated"] == 0  # type: ignore[index]
    assert agent.healthy()


def test_off_by_default(short_tmp: Path) -> None:
    agent = AgentProcess(short_tmp).start()
    try:
        # neither a route of the API nor a listener of its own
        status, _ = post(agent.port, "/debug/v1/admit", pod("a", 1))
        assert status in (404, 405)
    finally:
        agent.stop()


@pytest.mark.parametrize("address", ["0.0.0.0:9", "10.1.2.3:9", "127.0.0.1:", "127.0.0.1:x", "127.0.0.1"])
def test_needs_a_loopback_address(short_tmp: Path, address: str) -> None:
    argv = [sys.executable, "-m", "deviceplane", "agent", "--standalone", "--debug-admit-api", address,
            "--plugin-dir", str(short_tmp / "dp")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=60)
    assert done.returncode != 0 and "--debug-admit-api needs agent mode and a loopback address" in done.stderr


def test_an_incomplete_request_after_the_clients_eof_is_closed_once_the_one_in_flight_is_answered(
    short_tmp: Path,
) -> None:
    """A client pipelines an admit and the start of a second request (11 of its 100 body bytes), then half-closes.
    The admit is answered later (it waits up to --startup-plugin-wait for a plugin that never comes, then fails),
    and the rest of the second body can never come after the EOF: the server must close the connection then,
    instead of keeping the transport (and the client, reading for the end) forever."""
    port = free_port()
    agent = AgentProcess(
        short_tmp, "--debug-admit-api", f"127.0.0.1:{port}", "--startup-plugin-wait", "1s", plugin_dir=short_tmp / "dp"
    ).start()
    try:
        body = pod("p", 1)
        admit = b"POST /debug/v1/admit HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        partial = b'POST /debug/v1/admit HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"metadata"'
        with socket.create_connection(("127.0.0.1", port), timeout=6) as conn:
            conn.sendall(admit + partial)
            conn.shutdown(socket.SHUT_WR)
            received = bytearray()
            try:
                while chunk := conn.recv(65536):
                    received += chunk
                closed = True
            except TimeoutError:
                closed = False
        assert received.startswith(b"HTTP/1.1 200 OK"), bytes(received)  # the admit's answer: state failed
        assert b'"state": "failed"' in received or b'"state":"failed"' in received, bytes(received)
        assert closed, f"the half-closed connection stayed open 6 s after its answer: {bytes(received)[:60]!r}"
    finally:
        agent.kill()
