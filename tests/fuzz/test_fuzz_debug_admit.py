"""Fuzzing `--debug-admit-api`'s HTTP server (serving/lean_http.py) with raw bytes over a real socket: well-formed
requests, damaged ones, pipelined mixes and plain garbage, sent in random pieces. Every answer is a complete
HTTP/1.1 response with a JSON body, one of 200/400/404/405/413 (never a 500), at most one per request, and the agent
stays live and keeps admitting on a fresh connection."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.fuzz.conftest import assert_live
from tests.support.fuzz import fuzz_settings
from tests.support.procs import AgentProcess, free_port
from tests.support.raw_http import exchange, responses

MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def debug_agent(fuzz_root: Path) -> Iterator[tuple[AgentProcess, int]]:
    port = free_port()
    agent = AgentProcess(
        fuzz_root / "debug-admit",
        "--debug-admit-api", f"127.0.0.1:{port}",
        "--startup-plugin-wait", "0s",
    ).start()  # fmt: skip
    yield agent, port
    agent.kill()


def pod(name: str, resources: dict[str, str]) -> bytes:
    container = {"name": "c", "resources": {"limits": resources}}
    return json.dumps({"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {"containers": [container]}}).encode()


LIMITS = st.dictionaries(st.sampled_from(["x.io/r", "cpu"]), st.sampled_from(["1", "0", "-1", "x"]), max_size=2)
BODIES = st.one_of(
    st.builds(pod, st.text("abc", min_size=1, max_size=3), LIMITS),
    st.sampled_from([b"", b"{}", b"[]", b"null", b'{"uid": "uid-a"}', b'{"uid": 3}', b"{", b"[" * 5000, b"\xff\xfe"]),
    st.binary(max_size=64),
)
METHODS = st.sampled_from([b"POST", b"POST", b"GET", b"PUT", b"", b"P\x00ST", b"post"])
PATHS = st.sampled_from([b"/debug/v1/admit", b"/debug/v1/remove", b"/debug/v1/admit?x=1", b"/", b"*", b"/%00", b""])
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b""])
HEADERS = st.lists(
    st.sampled_from([b"Connection: close", b"Connection: keep-alive", b"Transfer-Encoding: chunked",
                     b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 99999999999",
                     b"Content-Length: 1e3", b" folded", b"No-Colon", b"X: \x00", b"Host: a\rb", b"X" * 9000,
                     b"Content-Type: application/json"]),
    max_size=3,
)  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    body = draw(BODIES)
    if draw(st.integers(0, 2)):  # two in three well-formed: the routes themselves get fuzzed too
        method = draw(st.sampled_from([b"POST", b"POST", b"POST", b"GET"]))
        path = draw(st.sampled_from([b"/debug/v1/admit", b"/debug/v1/remove", b"/debug/v1/nothing"]))
        version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
        extra = draw(st.sampled_from([b"", b"Connection: keep-alive\r\n", b"Connection: close\r\n"]))
        return b"%s %s %s\r\n%sContent-Length: %d\r\n\r\n%s" % (method, path, version, extra, len(body), body)
    line = b" ".join([draw(METHODS), draw(PATHS), draw(VERSIONS)])
    headers = draw(HEADERS)
    if draw(st.booleans()):  # a right Content-Length, placed anywhere
        headers.insert(draw(st.integers(0, len(headers))), b"Content-Length: %d" % len(body))
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    return line + eol + b"".join(h + eol for h in headers) + eol + body


STREAMS = st.lists(st.one_of(requests(), requests(), requests(), st.binary(max_size=200)), min_size=1, max_size=5)


def json_responses(data: bytes) -> list[tuple[int, bytes]]:
    """Every answer of the debug port is JSON."""
    found = []
    for status, fields, body in responses(data):
        assert fields[b"content-type"] == b"application/json"
        found.append((status, body))
    return found


def admit_ok(port: int) -> None:
    body = pod("alive", {})
    answer = exchange(port, b"POST /debug/v1/admit HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), [])
    [(status, payload)] = json_responses(answer)
    assert status == 200 and json.loads(payload)["admitted"] is True


@fuzz_settings(bounded=250, long=20_000)
@given(STREAMS, st.lists(st.integers(1, 64), max_size=4))
def test_fuzz_debug_admit_raw_bytes(
    debug_agent: tuple[AgentProcess, int], stream: list[bytes], pieces: list[int]
) -> None:
    agent, port = debug_agent
    answers = json_responses(exchange(port, b"".join(stream), pieces))
    assert len(answers) <= len(stream) + 1
    for status, payload in answers:
        assert status in (200, 400, 404, 405, 413), (status, payload)
        event(f"answered {status}")  # --hypothesis-show-statistics: the mix of answers reached
        answer = json.loads(payload)
        assert ("error" in answer) == (status != 200), answer
    admit_ok(port)
    assert_live(agent)


def test_body_too_large_is_refused_and_answered(debug_agent: tuple[AgentProcess, int]) -> None:
    _agent, port = debug_agent
    data = b"POST /debug/v1/admit HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1) + b"x" * (MAX_BODY + 1)
    [(status, payload)] = json_responses(exchange(port, data, []))
    assert status == 413 and b"body larger than" in payload


def test_pipelined_requests_are_answered_in_order(debug_agent: tuple[AgentProcess, int]) -> None:
    _agent, port = debug_agent
    bodies = [pod(f"pipe{i}", {}) for i in range(5)]
    requests_ = [b"POST /debug/v1/admit HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies]
    requests_.insert(2, b"GET /debug/v1/admit HTTP/1.1\r\n\r\n")
    answers = json_responses(exchange(port, b"".join(requests_), [7, 100]))
    assert [s for s, _ in answers] == [200, 200, 405, 200, 200, 200]
    uids = [json.loads(p)["uid"] for s, p in answers if s == 200]
    assert uids == [f"uid-pipe{i}" for i in range(5)]


def test_idle_keep_alive_connection_survives(debug_agent: tuple[AgentProcess, int]) -> None:
    _agent, port = debug_agent
    body = pod("idle", {})
    request = b"POST /debug/v1/admit HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection(("127.0.0.1", port), timeout=15) as conn:
        for _ in range(2):
            conn.sendall(request)
            received = b""
            while not received.endswith(b"}"):
                received += conn.recv(65536)
            [(status, _payload)] = json_responses(received)
            assert status == 200
            time.sleep(0.2)
