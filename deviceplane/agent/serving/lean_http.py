"""A minimal HTTP/1.1 server on asyncio.Protocol for a few routes: the agent's API (serving/http_api.py) and the debug
admit entry (serving/debug_admit.py).

Why not aiohttp: per request it builds a Request, a handler task and a streamed response, which the kubelet harness's
Go server does not pay: ~1 ms of event-loop CPU per admission through the debug entry when it was measured in the
agent, and 57-80 µs of server CPU per request alone against 33-43 µs for this server (benchmarks/entry_cpu.py,
benchmarks/README.md). Here a request is parsed as it arrives and handed to a callback that answers whenever it is
ready (`respond`), with no task of its own. Reads go into a buffer of the connection's own
(asyncio.BufferedProtocol): a plain Protocol's transport allocates a new 256 KiB bytes object per read, ~14 µs each
on this machine.

What it accepts: HTTP/1.0 and 1.1, routes by method and path (a GET route answers HEAD too, without the body), bodies
by Content-Length (no chunked encoding), keep-alive and pipelining (answers in request order, one request handled at
a time per connection), bounded header and body sizes. Anything else gets a JSON `{"error"}` answer: 400
(malformed), 404 (unknown path), 405 (a method the path does not take, with `Allow`), 413 (body too large); after a
400 or 413 the connection is closed, since its framing can no longer be trusted. A route that raises `HttpError`
answers its status with the message; one that raises anything else answers 500 and is logged.

Timeouts, which the aiohttp runner the agent had did not give (it kept an idle connection 3,630 s, its default, and
has no timeout of its own for a request being received): a keep-alive connection idle for KEEPALIVE_SECONDS is
closed, and a request not received in full within REQUEST_SECONDS of its first byte is answered 408 and its
connection closed (a client trickling bytes would otherwise hold a connection, and an fd, for as long as it likes).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qsl

log = logging.getLogger("deviceplane.http.lean")

MAX_HEADER_BYTES = 8192
MAX_BODY_BYTES = 1 << 20
LINGER_SECONDS = 2.0
KEEPALIVE_SECONDS = 75.0  # aiohttp's run_app default; Go's HTTP client drops idle connections after 90 s
REQUEST_SECONDS = 30.0
READ_BYTES = 64 << 10
# Bodies up to this size are sent joined to their head; larger ones after it, in views of their pieces.
_JOINED_BODY_LIMIT = 64 << 10
# The most handed to the transport at once: what it does not send at once it copies into its buffer.
_WRITE_CHUNK = 256 << 10
JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DIGITS = re.compile(rb"[0-9]{1,12}")


class HttpError(Exception):
    """A request refused: answered with `status` and `{"error": message}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


# A body, or a body in pieces sent one after another (never joined: /metrics of a large node is 12 MB).
Body = bytes | tuple[bytes, ...]


class Respond(Protocol):
    """A request's answer; a route calls it exactly once per request, whenever it is ready."""

    def __call__(self, status: int, body: Body, content_type: bytes = JSON, /) -> None: ...


@dataclass(slots=True, eq=False)
class Request:
    method: bytes
    path: bytes
    query: bytes  # after the `?`, undecoded
    length: int
    keep_alive: bool
    body: bytes = field(default=b"")

    def params(self) -> dict[str, str]:
        """The query's parameters, percent-decoded (UTF-8, undecodable bytes replaced), the first value of a name
        kept (as aiohttp's `request.query[name]` did)."""
        found: dict[str, str] = {}
        for name, value in parse_qsl(self.query.decode("utf-8", "replace"), keep_blank_values=True):
            found.setdefault(name, value)
        return found


Route = Callable[[Request, Respond], None]


def parse_head(head: bytes) -> Request:
    """The request line and headers (without the blank line that ends them)."""
    bare = head.replace(b"\r\n", b"")
    if b"\r" in bare or b"\n" in bare or b"\0" in bare:
        raise HttpError(400, "bare CR, LF or NUL in the request header")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1].startswith(b"/"):
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise HttpError(400, "only HTTP/1.0 and HTTP/1.1 are served")
    keep_alive = version == b"HTTP/1.1"
    length: int | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):  # also refuses obsolete line folding (a leading space)
            raise HttpError(400, "malformed header line")
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            if not _DIGITS.fullmatch(value) or (length is not None and length != int(value)):
                raise HttpError(400, "invalid Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            raise HttpError(400, "only Content-Length bodies are accepted, not Transfer-Encoding")
        elif name == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    path, _, query = target.partition(b"?")
    return Request(method, path, query, length or 0, keep_alive)


class _Connection(asyncio.BufferedProtocol):
    def __init__(
        self,
        routes: dict[bytes, dict[bytes, Route]],
        max_header: int,
        max_body: int,
        connections: set[_Connection],
    ) -> None:
        self._routes = routes
        self._connections = connections
        self._max_header = max_header
        self._max_body = max_body
        self._transport: asyncio.Transport | None = None
        self._read = memoryview(bytearray(READ_BYTES))
        self._buffer = bytearray()
        self._busy: Request | None = None  # the request a route is answering
        self.last_active = time.monotonic()  # for the keep-alive timeout: reads and answers
        self._partial_since: float | None = None  # when the request being read began to arrive
        self._closing = False  # answer what is in flight, then close
        self._paused = False
        self._in_next = False
        self._draining = False  # answered with an error: what the client still sends is discarded until close
        # Answers not yet handed to the transport, as views of their bodies (never copied): handed over a chunk at a
        # time while the transport takes them (`pause_writing` / `resume_writing`). Nothing else is written, and no
        # further request is handled, before they are all out: a client that does not read holds one answer.
        self._unsent: collections.deque[memoryview] = collections.deque()
        self._write_paused = False
        self._linger_when_sent = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None
        self._buffer.clear()
        self._unsent.clear()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self.last_active = time.monotonic()  # the client reads: not idle
        self._send_unsent()
        if not self._unsent:
            # Not from here: the transport calls this in the middle of its own write step, and closing it then
            # (the linger, or the client's EOF already read) made asyncio report the connection lost twice.
            asyncio.get_running_loop().call_soon(self._sent)

    def _sent(self) -> None:
        """Every answer handed over: go on with the connection."""
        if self._unsent or self._transport is None:
            return
        if self._linger_when_sent:
            self._linger_when_sent = False
            self._linger(self._transport)
        elif self._busy is None and (self._buffer or self._paused or self._closing):
            self._next()  # pipelined requests held back while the answer went out

    def idle_since(self, moment: float) -> bool:
        """No request in flight, and nothing read, answered or taken by the client since `moment`."""
        return self._busy is None and self.last_active < moment

    def stalled_since(self, moment: float) -> bool:
        """A request still being read that began to arrive before `moment`."""
        return self._busy is None and self._partial_since is not None and self._partial_since < moment

    def time_out(self, seconds: float) -> None:
        self._fail(408, f"request not received in full within {seconds:g}s")

    def close(self) -> None:
        """Close now (idle past the keep-alive timeout, or the server stopping). An answer the client has not taken
        is dropped (abort) rather than waited for: a client that stopped reading would otherwise keep the connection,
        its fd and its buffers until it goes away."""
        transport = self._transport
        if transport is None:
            return
        if self._unsent or transport.get_write_buffer_size():
            self._unsent.clear()
            transport.abort()
        self._close(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read

    def buffer_updated(self, nbytes: int) -> None:
        if self._draining:
            return
        self.last_active = time.monotonic()
        self._buffer += self._read[:nbytes]
        if self._busy is None and not self._unsent:
            self._next()
        elif not self._paused and len(self._buffer) > self._max_header + self._max_body and self._transport:
            # a pipelining client waits until the request in flight is answered and the answer taken
            self._paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._closing = True
        # False closes the transport; True keeps it open to answer the request in flight, or to finish sending an
        # answer (closing would drop what the transport has not been handed yet).
        return bool(self._unsent) or (self._busy is not None and not self._draining)

    def _next(self) -> None:
        """Handle buffered requests until one is in flight, the buffer holds no complete request, or it closes."""
        if self._in_next:
            return  # a route answered synchronously: the loop below goes on with the next request
        self._in_next = True
        try:
            self._next_requests()
        finally:
            self._in_next = False
        if self._paused and self._transport is not None and self._busy is None and not self._unsent:
            self._paused = False
            self._transport.resume_reading()

    def _next_requests(self) -> None:
        while self._busy is None and self._transport is not None and not self._draining and not self._unsent:
            if not self._buffer:
                self._partial_since = None
            elif self._partial_since is None:
                self._partial_since = self.last_active  # set by the read or the answer that led here
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > self._max_header:
                    self._fail(400, "request header too large")
                elif self._closing:
                    self._close(self._transport)  # nothing (or a partial request) left after the client's EOF
                return
            if end > self._max_header:
                self._fail(400, "request header too large")
                return
            try:
                request = parse_head(bytes(self._buffer[:end]))
            except HttpError as err:
                self._fail(err.status, str(err))
                return
            if request.length > self._max_body:
                self._fail(413, f"body larger than {self._max_body} bytes")
                return
            start = end + 4
            if len(self._buffer) < start + request.length:
                if self._closing:
                    self._close(self._transport)  # the client's EOF came first: the rest of this body never will
                return  # the body is still coming
            if request.length:
                request.body = bytes(self._buffer[start : start + request.length])
            del self._buffer[: start + request.length]
            self._partial_since = None
            self._dispatch(request)

    def _dispatch(self, request: Request) -> None:
        methods = self._routes.get(request.path)
        self._busy = request
        route = None if methods is None else methods.get(b"GET" if request.method == b"HEAD" else request.method)
        if methods is None:
            self._answer(request, 404, error_body("not found"))
        elif route is None:
            allowed = b", ".join(sorted(methods) + ([b"HEAD"] if b"GET" in methods else []))
            message = f"{request.method.decode('latin-1')} is not allowed here: {allowed.decode()}"
            self._answer(request, 405, error_body(message), JSON, b"Allow: %s\r\n" % allowed)
        else:
            # A second answer to the same request is dropped by `_answer` (the request is no longer the one in flight).
            respond: Respond = functools.partial(self._answer, request)
            try:
                route(request, respond)
            except HttpError as err:
                respond(err.status, error_body(str(err)))
            except Exception as err:  # a bug in a route answers 500; the server and the agent go on
                log.exception("HTTP route failed", extra={"path": request.path.decode("latin-1")})
                respond(500, error_body(f"internal error: {err}"))

    def _answer(
        self, request: Request, status: int, payload: Body, content_type: bytes = JSON, extra: bytes = b""
    ) -> None:
        if self._busy is not request:
            return
        self._busy = None
        self.last_active = time.monotonic()
        transport = self._transport
        if transport is None:
            return  # the client went away meanwhile
        close = not request.keep_alive
        extra += b"Connection: close\r\n" if close else b""
        self._write(status, payload, content_type, extra, request.method == b"HEAD")
        if close:
            self._linger(transport)
        elif not self._unsent and (self._buffer or self._paused or self._closing):
            self._next()  # pipelined requests; after the client's EOF, closes once they are answered

    def _fail(self, status: int, message: str) -> None:
        transport = self._transport
        if transport is None:
            return
        self._write(status, error_body(message), JSON, b"Connection: close\r\n")
        self._linger(transport)

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after an answer that ends the connection. Closing at once while the client is still sending (a body
        too large, pipelined requests after `Connection: close`) would reset the connection and could lose the
        answer: stop writing, discard what comes, and close at the client's EOF or after a short linger."""
        self._draining = True
        self._buffer.clear()
        if self._unsent:
            self._linger_when_sent = True  # the answer first: the linger starts once the client has taken it
            return
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self._close, transport)

    def _close(self, transport: asyncio.Transport) -> None:
        if self._transport is not transport:
            return  # already closed
        transport.close()
        self._connections.discard(self)
        self._transport = None
        self._buffer.clear()

    def _write(
        self,
        status: int,
        payload: Body,
        content_type: bytes,
        extra: bytes,
        head_only: bool = False,
    ) -> None:
        pieces = (payload,) if isinstance(payload, bytes) else payload
        length = sum(map(len, pieces))
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status,
            _REASONS.get(status, "Unknown").encode(),
            content_type,
            length,
            extra,
        )
        if head_only or length <= _JOINED_BODY_LIMIT:
            whole = head if head_only else b"".join((head, *pieces))  # one send: the count polls, the probes
            if not self._unsent and not self._write_paused and self._transport is not None:
                self._transport.write(whole)  # nothing waiting before it: straight to the transport
            else:
                self._unsent.append(memoryview(whole))
        else:
            # A large body (/metrics of a node with 100,000 devices: 12 MB in pieces kept by the agent) is neither
            # joined nor copied behind its head: it is handed over in views of its pieces.
            self._unsent.append(memoryview(head))
            self._unsent.extend(memoryview(piece) for piece in pieces if piece)
        self._send_unsent()

    def _send_unsent(self) -> None:
        """Hand the transport what it takes: a chunk at a time until it has more than its high-water mark buffered
        (it calls `pause_writing` inside `write`); the rest at `resume_writing`, which then goes on with the
        connection (the linger of an answer that ends it, or the pipelined requests)."""
        transport = self._transport
        while self._unsent and not self._write_paused and transport is not None:
            view = self._unsent[0]
            if len(view) > _WRITE_CHUNK:
                self._unsent[0] = view[_WRITE_CHUNK:]
                view = view[:_WRITE_CHUNK]
            else:
                self._unsent.popleft()
            transport.write(view)


class LeanHttpServer:
    """Routes by (method, path) on one address; `start` binds, `close` stops listening and drops the connections."""

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Route],
        max_header: int = MAX_HEADER_BYTES,
        max_body: int = MAX_BODY_BYTES,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        request_seconds: float = REQUEST_SECONDS,
    ) -> None:
        self._routes: dict[bytes, dict[bytes, Route]] = {}
        for (method, path), route in routes.items():
            self._routes.setdefault(path.encode("ascii"), {})[method.encode("ascii")] = route
        self._max_header = max_header
        self._max_body = max_body
        self._keepalive = keepalive_seconds
        self._request_seconds = request_seconds
        self._sweep_every = min(keepalive_seconds, request_seconds) / 2
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, address: str) -> None:
        """Listen on "HOST:PORT" ("[::1]:9450" too, as --http-addr accepts it; an empty host is 127.0.0.1)."""
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host.strip("[]") or "127.0.0.1", int(port))
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    def _connection(self) -> _Connection:
        return _Connection(self._routes, self._max_header, self._max_body, self._connections)

    def _sweep(self) -> None:
        """Close keep-alive connections idle for longer than the keep-alive timeout, and time out requests slower to
        arrive than the request timeout; checked every half of the shorter (one timer for all connections, rather
        than one per request)."""
        now = time.monotonic()
        for connection in list(self._connections):
            if connection.stalled_since(now - self._request_seconds):
                connection.time_out(self._request_seconds)
            elif connection.idle_since(now - self._keepalive):
                connection.close()
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_every, self._sweep)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):  # idle keep-alive ones too (wait_closed waits for them)
                connection.close()
            self._connections.clear()
            await self._server.wait_closed()
            self._server = None
