"""The agent's HTTP API (serving/http_api.py on serving/lean_http.py), over real sockets to a real agent: what a
client sees of each route, HEAD, the errors for unknown paths, other methods and bad queries, keep-alive, and no
connection left behind by clients that go away."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deviceplane.agent.serving.lean_http import JSON, LINGER_SECONDS, LeanHttpServer, Request, Respond, Route
from tests.support.procs import AgentProcess, wait_for
from tests.support.raw_http import exchange, responses


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(Path(tmp_path_factory.mktemp("http-api"))).start()
    yield process
    process.kill()


def request(agent: AgentProcess, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        conn.request(method, path)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def test_each_route_answers_with_its_content_type(agent: AgentProcess) -> None:
    status, headers, body = request(agent, "GET", "/api/v1/devices")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body)["agent"]["node"] == "test-node"
    status, headers, body = request(agent, "GET", "/api/v1/pods")
    assert (status, headers["content-type"], json.loads(body)) == (200, "application/json", [])
    status, headers, body = request(agent, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=")
    assert b"deviceplane_" in body
    for probe in ("/healthz", "/readyz"):
        assert request(agent, "GET", probe) == (
            200, {"content-type": "text/plain; charset=utf-8", "content-length": "2"}, b"ok",
        )  # fmt: skip


def test_head_answers_the_get_headers_without_a_body(agent: AgentProcess) -> None:
    _, get_headers, get_body = request(agent, "GET", "/api/v1/pods")
    # http.client reads no body for HEAD; the raw exchange below shows none is sent either
    status, headers, body = request(agent, "HEAD", "/api/v1/pods")
    assert (status, body) == (200, b"") and headers["content-length"] == str(len(get_body))
    assert headers["content-type"] == get_headers["content-type"]
    raw = exchange(agent.port, b"HEAD /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n", [])
    [(head_status, head_fields, head_body), (status, _, body)] = responses(raw)
    assert (head_status, head_fields[b"content-length"], head_body, status, body) == (200, b"2", b"", 200, b"ok")


def test_unknown_paths_other_methods_and_bad_queries_are_refused_with_the_reason(agent: AgentProcess) -> None:
    status, _, body = request(agent, "GET", "/api/v1/nothing")
    assert (status, json.loads(body)) == (404, {"error": "not found"})
    status, headers, body = request(agent, "POST", "/api/v1/devices")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert json.loads(body) == {"error": "POST is not allowed here: GET, HEAD"}
    status, _, body = request(agent, "DELETE", "/metrics")
    assert status == 405
    status, _, body = request(agent, "GET", "/api/v1/devices?limit=%C2%B2")
    assert status == 400 and json.loads(body) == {"error": "limit must be an integer from 0 to 999999999, got '²'"}
    status, _, body = request(agent, "GET", "/debug/fault?task=x")  # only with DEVICEPLANE_DEBUG_FAULTS=1
    assert status == 404
    assert agent.healthy()


def test_queries_are_decoded_and_the_first_value_counts(agent: AgentProcess) -> None:
    # %30 is "0": undecoded, the limit would be refused; the second limit would be too
    status, _, body = request(agent, "GET", "/api/v1/devices?limit=%30&limit=x&resource=example.com%2Fnone")
    assert status == 200 and json.loads(body)["resources"] == []
    status, _, body = request(agent, "GET", "/api/v1/devices?limit=x&limit=%30")
    assert status == 400 and json.loads(body)["error"].endswith("got 'x'")


async def exchange_with(
    routes: dict[tuple[str, str], Route], sent: bytes, timeout: float, read_after: float = 0.0
) -> tuple[bytes, float]:
    """Serve `routes`, send `sent` on one connection, wait `read_after` seconds without reading, then read until the
    server closes: what was received, and when reading began (time.monotonic)."""
    server = LeanHttpServer(routes)
    await server.start("127.0.0.1:0")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(sent)
        await asyncio.sleep(read_after)
        reading_from = time.monotonic()
        received = await asyncio.wait_for(reader.read(), timeout)
        writer.close()
        return received, reading_from
    finally:
        await server.close()


def test_a_second_answer_to_a_request_is_dropped() -> None:
    """A route that answers twice: the client gets one answer, and the next request on the connection its own."""

    def twice(_request: Request, respond: Respond) -> None:
        respond(200, b'{"first":1}', JSON)
        respond(500, b'{"second":1}', JSON)

    sent = b"GET /twice HTTP/1.1\r\n\r\nGET /twice HTTP/1.1\r\nConnection: close\r\n\r\n"
    received, _ = asyncio.run(exchange_with({("GET", "/twice"): twice}, sent, 3))
    answers = responses(received)
    assert [(status, body) for status, _, body in answers] == [(200, b'{"first":1}'), (200, b'{"first":1}')]


def test_a_large_body_arrives_whole_between_small_answers_on_one_connection() -> None:
    """Bodies over 64 KiB go after their head, as views the transport slices, and a body in pieces piece after piece
    (the /metrics of a node with many devices): pipelined with small answers and a HEAD, each arrives whole, framed by
    its Content-Length, in order."""
    large = bytes(range(256)) * (3 << 12) + b"end"  # 3 MiB and a tail: more than the socket takes at once
    pieces = (b"head\n", b"", large[:100_000], large[100_000:])

    def big(_request: Request, respond: Respond) -> None:
        respond(200, large, b"text/plain")

    def in_pieces(_request: Request, respond: Respond) -> None:
        respond(200, pieces, b"text/plain")

    def small(_request: Request, respond: Respond) -> None:
        respond(200, (b'{"sm', b'all":1}'), JSON)  # small pieces: joined to the head

    routes = {("GET", "/big"): big, ("GET", "/pieces"): in_pieces, ("GET", "/small"): small}
    sent = (
        b"GET /small HTTP/1.1\r\n\r\nGET /big HTTP/1.1\r\n\r\nHEAD /big HTTP/1.1\r\n\r\n"
        b"GET /pieces HTTP/1.1\r\n\r\nHEAD /pieces HTTP/1.1\r\n\r\n"
        b"GET /big HTTP/1.1\r\n\r\nGET /small HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    received, _ = asyncio.run(exchange_with(routes, sent, 10))
    answers = responses(received)
    assert [(status, fields[b"content-length"], body) for status, fields, body in answers] == [
        (200, b"11", b'{"small":1}'),
        (200, str(len(large)).encode(), large),
        (200, str(len(large)).encode(), b""),
        (200, str(len(b"head\n" + large)).encode(), b"head\n" + large),
        (200, str(len(b"head\n" + large)).encode(), b""),
        (200, str(len(large)).encode(), large),
        (200, b"11", b'{"small":1}'),
    ]


def test_keep_alive_serves_many_requests_on_one_connection(agent: AgentProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=10)
    try:
        ports = set()
        for path in ("/healthz", "/api/v1/devices?limit=0", "/metrics", "/api/v1/nothing", "/readyz"):
            conn.request("GET", path)
            conn.getresponse().read()
            assert conn.sock is not None
            ports.add(conn.sock.getsockname()[1])
        assert len(ports) == 1  # one connection, kept
    finally:
        conn.close()


def open_fds(agent: AgentProcess) -> int:
    assert agent.proc is not None
    return len(os.listdir(f"/proc/{agent.proc.pid}/fd"))


def test_clients_that_go_away_leave_no_connection_behind(agent: AgentProcess) -> None:
    """Half a request, a whole one never read, a reset: each connection the agent had is closed with the client's."""
    request(agent, "GET", "/healthz")
    before = open_fds(agent)
    for i in range(60):
        conn = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        if i % 3 == 0:
            conn.sendall(b"GET /api/v1/devi")  # half a request line
        elif i % 3 == 1:
            conn.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # an answer never read
        else:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        conn.close()
    wait_for(lambda: open_fds(agent) <= before, timeout=10, what=f"the agent's fds back to {before}")
    assert agent.healthy()


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    """The keep-alive timeout: an idle client does not hold a connection (and an fd) forever; one with
    a request in flight is not cut."""

    async def scenario() -> tuple[bytes, bytes, bytes]:
        loop = asyncio.get_running_loop()
        held: list[Respond] = []

        def slow(_request: Request, respond: Respond) -> None:
            held.append(respond)  # answered later, well past the timeout

        def fast(_request: Request, respond: Respond) -> None:
            respond(200, b"{}", JSON)

        server = LeanHttpServer({("GET", "/slow"): slow, ("GET", "/fast"): fast}, keepalive_seconds=0.2)
        await server.start("127.0.0.1:0")
        try:
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", server.port)
            idle_writer.write(b"GET /fast HTTP/1.1\r\n\r\n")
            busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", server.port)
            busy_writer.write(b"GET /slow HTTP/1.1\r\n\r\n")
            started = time.monotonic()
            answered = await asyncio.wait_for(idle_reader.read(4096), 2)
            closed = await asyncio.wait_for(idle_reader.read(4096), 2)  # b"": the server closed it
            assert 0.2 <= time.monotonic() - started < 1.5
            await asyncio.sleep(0.3)
            loop.call_soon(held[0], 200, b'{"late":1}', JSON)
            late = await asyncio.wait_for(busy_reader.read(4096), 2)
            idle_writer.close()
            busy_writer.close()
            return answered, closed, late
        finally:
            await server.close()

    answered, closed, late = asyncio.run(scenario())
    assert answered.startswith(b"HTTP/1.1 200 OK") and closed == b""
    assert late.startswith(b"HTTP/1.1 200 OK") and late.endswith(b'{"late":1}')


def test_a_request_slower_to_arrive_than_the_request_timeout_is_answered_408_and_closed() -> None:
    """A client that trickles a request (a byte at a time, never idle long enough for the keep-alive timeout) would
    hold its connection as long as it likes: it gets a 408 and the connection is closed. A connection with a request
    in flight, or one that sent whole requests, is not cut."""

    async def scenario() -> tuple[bytes, float, bytes, bytes]:
        loop = asyncio.get_running_loop()
        held: list[Respond] = []

        def slow(_request: Request, respond: Respond) -> None:
            held.append(respond)

        def fast(_request: Request, respond: Respond) -> None:
            respond(200, b"{}", JSON)

        server = LeanHttpServer(
            {("GET", "/slow"): slow, ("GET", "/fast"): fast}, keepalive_seconds=60, request_seconds=0.3
        )
        await server.start("127.0.0.1:0")
        try:
            trickle_reader, trickle_writer = await asyncio.open_connection("127.0.0.1", server.port)
            busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", server.port)
            busy_writer.write(b"GET /slow HTTP/1.1\r\n\r\n")
            whole_reader, whole_writer = await asyncio.open_connection("127.0.0.1", server.port)
            sent = 0

            async def trickle() -> None:  # a byte every 30 ms on one connection, whole requests on another
                nonlocal sent
                for byte in b"GET /fast HTTP/1.1\r\nX-Slow: yes":
                    trickle_writer.write(bytes([byte]))
                    whole_writer.write(b"GET /fast HTTP/1.1\r\n\r\n")
                    sent += 1
                    await asyncio.sleep(0.03)

            started = time.monotonic()
            trickling = asyncio.create_task(trickle())
            timed_out = await asyncio.wait_for(trickle_reader.read(), 3)  # until the server ends the connection
            elapsed = time.monotonic() - started
            trickling.cancel()
            await asyncio.gather(trickling, return_exceptions=True)
            loop.call_soon(held[0], 200, b'{"late":1}', JSON)
            late = await asyncio.wait_for(busy_reader.readuntil(b'{"late":1}'), 3)
            whole_writer.write(b"GET /fast HTTP/1.1\r\nConnection: close\r\n\r\n")
            whole = await asyncio.wait_for(whole_reader.read(), 3)
            assert whole.count(b"HTTP/1.1 200 OK") == sent + 1, (sent, whole[-200:])  # every one answered, then closed
            for writer in (trickle_writer, busy_writer, whole_writer):
                writer.close()
            return timed_out, elapsed, late, whole
        finally:
            await server.close()

    timed_out, elapsed, late, whole = asyncio.run(scenario())
    assert timed_out.startswith(b"HTTP/1.1 408 Request Timeout") and b"Connection: close" in timed_out
    assert timed_out.endswith(b'{"error": "request not received in full within 0.3s"}')
    assert 0.3 <= elapsed < 1.5
    assert late.startswith(b"HTTP/1.1 200 OK")
    assert whole.endswith(b"{}")


def test_a_static_pod_file_whose_name_is_not_utf8_is_listed(tmp_path: Path) -> None:
    """os.scandir keeps such a name's bytes as lone surrogates, which UTF-8 JSON cannot carry: /api/v1/pods still
    answers, the name's byte as a \\u escape, and the pod beside it is listed as usual."""
    pods = tmp_path / "pods"
    pods.mkdir()
    manifest = (
        b"apiVersion: v1\nkind: Pod\nmetadata: {name: %s, namespace: default, uid: %s}\n"
        b"spec: {containers: [{name: c, image: x}]}\n"
    )
    (pods / "plain.yaml").write_bytes(manifest % (b"plain", b"u-plain"))
    with open(os.fsencode(pods) + b"/odd-\xff.yaml", "wb") as odd:
        odd.write(manifest % (b"odd", b"u-odd"))
    agent = AgentProcess(tmp_path, "--pod-manifest-dir", str(pods), "--startup-plugin-wait", "0s").start()
    try:

        def both_admitted() -> list[dict[str, Any]] | None:
            found = agent.get("/api/v1/pods")
            return found if len(found) == 2 and all(pod["admitted"] for pod in found) else None

        listed = wait_for(both_admitted, what="both pods admitted")
        assert sorted((pod["name"], pod["source"], pod["admitted"]) for pod in listed) == [
            ("odd", "file:odd-\udcff.yaml", True),
            ("plain", "file:plain.yaml", True),
        ]
    finally:
        agent.kill()


@pytest.mark.parametrize(
    ("size", "requests", "most_unread"),
    [
        (3 << 20, 50, 3),  # large answers, handed over in views
        (60 << 10, 500, 200),  # small ones, joined to their head: what ~4 MB of socket buffers take, at most
    ],
)
def test_a_client_that_does_not_read_holds_one_answer_not_every_pipelined_one(
    size: int, requests: int, most_unread: int
) -> None:
    """Pipelined requests from a client that does not read: the server handles the next request only once the
    previous answer is out, so the connection holds one answer, not every one (before, every answer was buffered:
    146 MB for fifty of 3 MB). Once the client reads, every answer arrives, whole and in order."""
    body = bytes(range(256)) * (size // 256)
    handled: list[float] = []  # when each request was handled

    def answer(_request: Request, respond: Respond) -> None:
        handled.append(time.monotonic())
        respond(200, (b"%d:" % len(handled), body), b"text/plain")

    sent = b"GET /a HTTP/1.1\r\n\r\n" * (requests - 1) + b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n"
    received, reading_from = asyncio.run(exchange_with({("GET", "/a"): answer}, sent, 30, read_after=0.5))
    handled_unread = sum(1 for moment in handled if moment < reading_from)
    assert handled_unread <= most_unread, handled_unread  # what the socket buffers took, at most
    answers = responses(received)
    assert len(handled) == len(answers) == requests
    assert [got for _status, _fields, got in answers] == [b"%d:" % (i + 1) + body for i in range(requests)]


def test_a_large_answer_that_ends_the_connection_reaches_a_client_slower_than_the_linger() -> None:
    """`Connection: close` lingers 2 s for the client's EOF before closing: with a large answer still going out, the
    linger starts once the client has taken it, so a client that reads late still gets all of it."""
    large = bytes(range(256)) * (48 << 12)  # 48 MiB: more than the socket buffers take without a read

    def big(_request: Request, respond: Respond) -> None:
        respond(200, large, b"text/plain")

    sent = b"GET /big HTTP/1.1\r\nConnection: close\r\n\r\n"
    received, _ = asyncio.run(exchange_with({("GET", "/big"): big}, sent, 10, read_after=LINGER_SECONDS + 0.5))
    ((status, fields, body),) = responses(received)
    assert status == 200 and fields[b"connection"] == b"close" and body == large


@pytest.mark.parametrize("close", [False, True])
def test_a_large_answer_reaches_a_client_that_half_closed_after_its_request(close: bool) -> None:
    """A client that sends its request and shuts its side (curl does not, scripts do) still gets all of a large
    answer, kept alive or not: its EOF does not drop what the server has not handed to the socket yet, and nothing
    fails inside the event loop as the connection closes after it (asyncio logs such a failure; collected here)."""
    large = bytes(range(256)) * (48 << 12)  # 48 MiB
    problems: list[object] = []

    async def scenario() -> bytes:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: problems.append(context))

        def big(_request: Request, respond: Respond) -> None:
            respond(200, large, b"text/plain")

        server = LeanHttpServer({("GET", "/big"): big})
        await server.start("127.0.0.1:0")
        try:
            request = b"GET /big HTTP/1.1\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n"
            return await asyncio.to_thread(exchange, server.port, request, [])
        finally:
            await server.close()

    ((status, _fields, body),) = responses(asyncio.run(scenario()))
    assert status == 200 and body == large
    assert problems == []


def test_a_client_that_stops_reading_is_dropped_after_the_keep_alive_timeout() -> None:
    """A connection idle past the keep-alive timeout is closed even with an answer the client never took: dropped,
    not waited for, so a client that stops reading does not keep the server's socket (and the answer's buffers)."""
    large = bytes(range(256)) * (48 << 12)  # 48 MiB: more than the socket buffers take without a read

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def scenario() -> tuple[int, int, int]:
        def big(_request: Request, respond: Respond) -> None:
            respond(200, large, b"text/plain")

        server = LeanHttpServer({("GET", "/big"): big}, keepalive_seconds=0.3)
        await server.start("127.0.0.1:0")
        try:
            before = open_fds()
            _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /big HTTP/1.1\r\n\r\n")
            await asyncio.sleep(0.1)
            serving = open_fds()  # the client's socket and the server's
            await asyncio.sleep(1.0)  # not reading, past the timeout
            dropped = open_fds()  # the client's socket alone
            writer.close()
            return before, serving, dropped
        finally:
            await server.close()

    before, serving, dropped = asyncio.run(scenario())
    assert (serving - before, dropped - before) == (2, 1)
