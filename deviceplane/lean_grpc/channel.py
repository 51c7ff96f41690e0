"""A gRPC channel to one unix socket: dials lazily, keeps one HTTP/2 connection, makes unary and server-streaming
calls with wire bytes in and out.

Behaviour follows grpc's defaults where the agent can see them: a call without `wait_for_ready` fails fast with
UNAVAILABLE when the server cannot be dialled, one with it retries the dial until its deadline; a deadline is sent as
grpc-timeout and enforced here (RST_STREAM, DEADLINE_EXCEEDED); a call the server never processed (GOAWAY,
REFUSED_STREAM) is sent again, a few times at most; the largest message received is 4 MiB. Messages follow
grpc-go, whose text the kubelet prints ("context deadline exceeded", "error reading from server: EOF", ...).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from deviceplane.lean_grpc.connection import Connection, Stream
from deviceplane.lean_grpc.headers import request_block, timeout_field
from deviceplane.lean_grpc.status import RpcError, UnprocessedError

DEFAULT_MAX_MESSAGE = 4 << 20  # grpc's default receive limit, the kubelet's too
DEADLINE_MESSAGE = "context deadline exceeded"
USER_AGENT = "deviceplane-lean-grpc/1"
DIAL_TIMEOUT_SECONDS = 20.0  # a dial without a deadline still ends (a unix connect only waits on a full backlog)
FIRST_BACKOFF_SECONDS = 0.01  # wait_for_ready: redial after this, growing to MAX_BACKOFF_SECONDS
MAX_BACKOFF_SECONDS = 1.0
# Sends of a call the server did not process (GOAWAY, REFUSED_STREAM). A server at its stream limit may still count
# a stream whose trailers we have read (C-core does, briefly), so a call started at once on the freed slot can be
# refused: the next try follows a short pause, growing with each try (the server's cleanup is quick; waiting for
# another of our streams to end instead could wait forever behind a ListAndWatch).
MAX_TRANSPARENT_RETRIES = 20
RETRY_PAUSE_SECONDS = 0.002

T = TypeVar("T")


def dial_error(path: str, err: OSError) -> str:
    reason = (err.strerror or str(err)).lower()
    return f'connection error: desc = "transport: Error while dialing: dial unix {path}: connect: {reason}"'


class Channel:
    def __init__(self, path: str, authority: str = "localhost", max_receive_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self.path = path
        self._authority = authority
        self._max_message = max_receive_message
        self._connection: Connection | None = None
        self._dialing: asyncio.Task[Connection] | None = None
        self._blocks: dict[str, bytes] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connected_once = False  # a server answered the HTTP/2 handshake at some point (grpc's READY)
        self.retries = 0  # calls sent again because the server did not take them (GOAWAY, REFUSED_STREAM)

    # -- calls ---------------------------------------------------------------------------------------------------------

    async def unary(
        self,
        method: str,
        request: bytes,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        sent_timeout: float | None = None,
    ) -> bytes:
        """One unary call (`method` as "/package.Service/Method"): the response message, or RpcError. `sent_timeout`
        (at most `timeout`): the deadline sent to the server, when the server is to reach its own first and answer
        in its own words (a proxy's case); by default `timeout`'s."""
        loop = self._loop or self._bind_loop()
        deadline = None if timeout is None else loop.time() + timeout
        sent = deadline if sent_timeout is None else loop.time() + sent_timeout
        retries = 0
        while True:
            connection = self._connection
            if connection is None or not connection.takes_call:
                connection = await self._ready(deadline, wait_for_ready)
            future: asyncio.Future[bytes] = loop.create_future()
            stream = connection.start(self._request_block(method, sent, loop), request, future)
            timer = None
            if deadline is not None:
                timer = loop.call_at(deadline, _expire, connection, stream)
            try:
                return await future
            except RpcError as err:
                expired = deadline is not None and loop.time() >= deadline
                if expired and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The server's copy of our deadline (grpc-timeout, counted from its receipt, so never earlier)
                    # can answer before our timer, in its own words (a grpc.aio server says "Deadline Exceeded"): the
                    # same deadline, reported one way. A DEADLINE_EXCEEDED of the server's own, earlier, passes as is.
                    raise _deadline_error() from None
                if not isinstance(err, UnprocessedError):
                    raise
                if retries == MAX_TRANSPARENT_RETRIES:
                    raise
                retries += 1  # the server never saw it: again, after a pause (then, if at its limit, for a slot)
                self.retries += 1
                await _until(asyncio.sleep(min(RETRY_PAUSE_SECONDS * retries, MAX_BACKOFF_SECONDS)), deadline, loop)
            except asyncio.CancelledError:
                connection.cancel(stream, RpcError(grpc.StatusCode.CANCELLED, "context canceled"))
                raise
            finally:
                if timer is not None:
                    timer.cancel()

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        """The channel's loop, found once: in CPython 3.11 get_running_loop() makes a getpid() syscall whenever
        another thread touched asyncio since (~6 us here), and a channel serves one loop."""
        self._loop = asyncio.get_running_loop()
        return self._loop

    def stream(self, method: str, request: bytes) -> ResponseStream:
        """A server-streaming call. Its request is sent now when the channel is connected (else on the first read),
        so a caller that returns right after this has its request on the way."""
        started = None
        connection = self._connection
        if connection is not None and connection.takes_call:
            started = (connection, connection.start(self._request_block(method, None, None), request, None))
        return ResponseStream(started, lambda: self._open_stream(method, request))

    async def close(self) -> None:
        """Close the connection, as grpc-go's ClientConn.Close: unary calls in flight fail with UNAVAILABLE (the
        transport's close reaches them: the kubelet, closing its client when a plugin's stream ends, reads that),
        streams and later calls with CANCELLED "grpc: the client connection is closing"."""
        self._closed = True
        dialing, self._dialing = self._dialing, None
        if dialing is not None:
            dialing.cancel()
            with contextlib.suppress(BaseException):
                await dialing
        if self._connection is not None:
            self._connection.close(_closed_error(), _closing_transport_error(self._connection.goaway))
            self._connection = None

    # -- connecting ----------------------------------------------------------------------------------------------------

    def _request_block(self, method: str, deadline: float | None, loop: asyncio.AbstractEventLoop | None) -> bytes:
        block = self._blocks.get(method)
        if block is None:
            block = self._blocks[method] = request_block(method, self._authority, USER_AGENT)
        if deadline is not None and loop is not None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _deadline_error()
            block += timeout_field(remaining)
        return block

    async def _open_stream(self, method: str, request: bytes) -> tuple[Connection, Stream]:
        connection = await self._ready(None, False)
        return connection, connection.start(self._request_block(method, None, None), request, None)

    async def _ready(self, deadline: float | None, wait_for_ready: bool) -> Connection:
        """A connection that takes a call now: the current one, or a new dial (one at a time, shared)."""
        loop = asyncio.get_running_loop()
        backoff = FIRST_BACKOFF_SECONDS
        while True:
            if self._closed:
                raise _closed_error()
            connection = self._connection
            if connection is not None and connection.usable:
                if connection.has_slot():
                    return connection
                await _until(connection.wait_slot(), deadline, loop)
                continue
            if self._dialing is None:
                self._dialing = loop.create_task(self._dial())
                self._dialing.add_done_callback(self._dialled)
            try:
                dialled = await _until(asyncio.shield(self._dialing), deadline, loop)
            except OSError as err:
                if not wait_for_ready:
                    raise RpcError(grpc.StatusCode.UNAVAILABLE, dial_error(self.path, err)) from None
            else:
                if dialled.usable:
                    continue  # taken by _dial as it ended
                if not wait_for_ready:  # connected, and lost (or refused) at once
                    raise dialled.error or RpcError(grpc.StatusCode.UNAVAILABLE, "connection closed")
            if deadline is not None and loop.time() + backoff >= deadline:
                await _until(asyncio.sleep(max(0.0, deadline - loop.time())), None, loop)
                raise _deadline_error()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 1.6, MAX_BACKOFF_SECONDS)

    async def _dial(self) -> Connection:
        loop = asyncio.get_running_loop()
        _transport, connection = await asyncio.wait_for(
            loop.create_unix_connection(lambda: Connection(self._max_message, self._lost, self._handshake), self.path),
            DIAL_TIMEOUT_SECONDS,
        )
        # Taken here, as the dial ends, not in its done-callback (which the loop runs on a later turn): a call that
        # comes in between must find it. It found none and awaited the finished dial again and again, never letting
        # the loop turn: the agent froze (seen in tests/e2e/test_proxy.py's kill -9 test).
        # A connection this one replaces is draining (GOAWAY, or its stream ids used up): its calls in flight finish
        # there, and it closes itself after the last (Connection._finish).
        if not self._closed:
            self._connection = connection
        return connection

    def _dialled(self, task: asyncio.Task[Connection]) -> None:
        if self._dialing is task:
            self._dialing = None
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            return  # the waiting callers have it (retrieved here too, so an abandoned dial logs nothing)
        if self._closed:
            task.result().close(_closed_error())

    def _handshake(self) -> None:
        self.connected_once = True

    def _lost(self, connection: Connection) -> None:
        if self._connection is connection:
            self._connection = None


class ResponseStream:
    """The messages of a server-streaming call, as wire bytes: `async for message in stream`. Ends at the server's OK
    status, raises RpcError for any other; `cancel()` ends it from this side."""

    def __init__(
        self,
        started: tuple[Connection, Stream] | None,
        open_stream: Callable[[], Awaitable[tuple[Connection, Stream]]],
    ) -> None:
        self._started = started
        self._open = open_stream

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> bytes:
        if self._started is None:
            self._started = await self._open()
        connection, stream = self._started
        loop = asyncio.get_running_loop()
        while True:
            message = connection.take(stream)
            if message is not None:
                return message
            if stream.done:
                if stream.error is not None:
                    raise stream.error
                raise StopAsyncIteration
            stream.waiter = loop.create_future()
            try:
                await stream.waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                stream.waiter = None

    def cancel(self) -> None:
        if self._started is not None:
            connection, stream = self._started
            connection.cancel(stream, RpcError(grpc.StatusCode.CANCELLED, "context canceled"))


async def _until(awaitable: Awaitable[T], deadline: float | None, loop: asyncio.AbstractEventLoop) -> T:
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - loop.time()))
    except TimeoutError:
        raise _deadline_error() from None


def _deadline_error() -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)


def _expire(connection: Connection, stream: Stream) -> None:
    """A call's deadline timer: its error is made only when it fires (most calls end first)."""
    connection.cancel(stream, _deadline_error())


def _closed_error() -> RpcError:
    return RpcError(grpc.StatusCode.CANCELLED, "grpc: the client connection is closing")


def _closing_transport_error(goaway: str | None) -> RpcError:
    """What grpc-go's transport Close gives its unary calls in flight when the ClientConn closes: UNAVAILABLE, with
    the text of the close's error, and the server's GOAWAY if one came (http2Client.Close)."""
    why = f"rpc error: code = Canceled desc = {_closed_error().details()}"
    if goaway is not None:
        why = f"closing transport due to: {why}, received prior goaway: {goaway}"
    return RpcError(grpc.StatusCode.UNAVAILABLE, why)
