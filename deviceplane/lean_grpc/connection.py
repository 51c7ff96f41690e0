"""One HTTP/2 connection to a gRPC server, client side (RFC 9113), as an asyncio.BufferedProtocol on the event loop.

What it does: opens streams for calls (request HEADERS, then the request as one length-prefixed message in DATA),
reads each stream's response headers, messages and trailers, and keeps the connection's obligations: SETTINGS and
their ACKs, PING ACKs, flow control both ways (the request waits for window; the receive windows are large and
topped up as data is consumed), GOAWAY (no new streams; streams the server never saw fail as retryable), RST_STREAM,
CONTINUATION, padding. A peer that breaks the protocol gets a GOAWAY and the connection is closed; every call on it
fails with a status saying why. Nothing here blocks or spawns a task.

Reads go into one preallocated buffer (`get_buffer`/`buffer_updated`): a plain Protocol's transport allocates a new
256 KiB bytes object for every read, which cost ~14 µs per read on this machine, more than a small call's parsing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import grpc

from deviceplane.lean_grpc import frames as h2
from deviceplane.lean_grpc.headers import HeaderDecodeError, HeaderDecoder, grpc_message
from deviceplane.lean_grpc.status import RpcError, UnprocessedError, http_status_error, status_code, trailing_metadata

log = logging.getLogger("deviceplane.lean_grpc")

# Receive windows: large enough that a unary response (at most the message limit) never waits for an update, so the
# common call costs no WINDOW_UPDATE at all; the connection's is topped up once half is used.
STREAM_WINDOW = 8 << 20
CONNECTION_WINDOW = 64 << 20
MAX_BUFFERED = 16 << 20  # a stream's received, unread messages beyond this stop its window updates (backpressure)
MAX_FRAME_IN = h2.DEFAULT_MAX_FRAME  # we never announce a larger SETTINGS_MAX_FRAME_SIZE
MAX_HEADER_LIST = 64 << 10  # announced as SETTINGS_MAX_HEADER_LIST_SIZE; a larger block is refused
READ_BUFFER = 64 << 10  # per connection, resident: one per plugin
MIN_READ_ROOM = MAX_FRAME_IN + h2.HEADER_SIZE  # a partial frame is moved to the front when less is left behind it
MAX_WRITE_BACKLOG = 4 << 20  # a server that stops reading while making us answer it is dropped

_CLIENT_SETTINGS = h2.settings(
    {
        h2.SETTINGS_ENABLE_PUSH: 0,
        h2.SETTINGS_INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        h2.SETTINGS_MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
    }
)
_SETTINGS_ACK = h2.frame(h2.SETTINGS, h2.ACK, 0)
_PREAMBLE = h2.PREFACE + _CLIENT_SETTINGS + h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW)

# RST_STREAM from the server -> the call's status (grpc-go's mapping).
_RST_CODES = {
    h2.CANCEL: grpc.StatusCode.CANCELLED,
    h2.ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    h2.INADEQUATE_SECURITY: grpc.StatusCode.PERMISSION_DENIED,
}


class ConnectionFailure(Exception):
    """The peer broke the protocol: the whole connection goes (GOAWAY with `code`)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def go_quoted(data: bytes) -> str:
    """`data` as Go's %q writes it, for ASCII: in double quotes, printable characters as is, the rest escaped (any
    other byte as \\xNN, where Go would keep printable UTF-8)."""
    out = []
    for byte in data:
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append({0x0A: "\\n", 0x09: "\\t", 0x0D: "\\r"}.get(byte, f"\\x{byte:02x}"))
    return '"' + "".join(out) + '"'


class StreamFailure(Exception):
    """The peer broke the protocol on one stream: that stream is reset and its call fails with `error`."""

    def __init__(self, error: RpcError, code: int = h2.PROTOCOL_ERROR) -> None:
        super().__init__(str(error))
        self.error = error
        self.code = code


class Stream:
    """One call's stream. A unary call resolves `future` with its one response message; a server-streaming call queues
    `messages` and wakes `waiter`."""

    __slots__ = (
        "buffer",
        "buffered",
        "done",
        "error",
        "future",
        "http_status",
        "id",
        "messages",
        "pending",
        "recv_unacked",
        "recv_window",
        "response",
        "send_window",
        "waiter",
    )

    def __init__(self, stream_id: int, future: asyncio.Future[bytes] | None, send_window: int) -> None:
        self.id = stream_id
        self.future = future  # None: a streaming call
        self.messages: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.buffer = bytearray()  # a message still arriving
        self.buffered = 0  # bytes in `messages`
        self.response: bytes | None = None
        self.http_status: str | None = None  # set once the response headers are in
        self.done = False
        self.error: RpcError | None = None
        self.send_window = send_window
        self.recv_window = STREAM_WINDOW
        self.recv_unacked = 0
        self.pending = memoryview(b"")  # request bytes waiting for flow-control window


class Connection(asyncio.BufferedProtocol):
    def __init__(
        self,
        max_message: int,
        on_lost: Callable[[Connection], None] | None = None,
        on_handshake: Callable[[], None] | None = None,
    ) -> None:
        self._max_message = max_message
        self._on_lost = on_lost
        self._on_handshake = on_handshake  # the server's first SETTINGS: it speaks HTTP/2 (grpc's READY)
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(READ_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._streams: dict[int, Stream] = {}
        self._next_id = 1
        self._decoder = HeaderDecoder(MAX_HEADER_LIST)
        self._block: bytearray | None = None  # a header block waiting for its CONTINUATION frames
        self._block_stream = 0
        self._block_end_stream = False
        self._send_window = h2.DEFAULT_WINDOW
        self._recv_window = CONNECTION_WINDOW
        self._recv_unacked = 0
        self._peer_stream_window = h2.DEFAULT_WINDOW
        self._peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._peer_max_streams: int | None = None
        self._blocked: list[Stream] = []  # streams with request bytes waiting for window, oldest first
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._draining = False  # GOAWAY received (or stream ids used up): no new streams
        self.error: RpcError | None = None  # why the connection ended
        self._unary_error: RpcError | None = None  # what unary calls in flight fail with instead (close's)
        self.goaway: str | None = None  # the server's GOAWAY, as grpc-go words it ("code: NO_ERROR, debug data: ...")

    # -- asyncio.BufferedProtocol ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a unix stream transport
        transport.write(_PREAMBLE)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        if len(self._buffer) - self._end < MIN_READ_ROOM and self._start:
            kept = self._end - self._start
            self._buffer[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        view, pos, end = self._view, self._start, self._end
        try:
            while end - pos >= h2.HEADER_SIZE:
                kind_length, flags, stream_id = h2.HEADER.unpack_from(view, pos)
                length = kind_length >> 8
                if length > MAX_FRAME_IN:
                    raise ConnectionFailure(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {MAX_FRAME_IN}")
                stop = pos + h2.HEADER_SIZE + length
                if stop > end:
                    break
                payload = bytes(view[pos + h2.HEADER_SIZE : stop])
                pos = stop
                self._frame(kind_length & 0xFF, flags, stream_id & h2.STREAM_ID_MASK, payload)
                if self._transport is None:
                    return
        except ConnectionFailure as failure:
            self._fail(failure.code, str(failure))
            return
        if pos == end:
            self._start = self._end = 0
        else:
            self._start = pos

    def eof_received(self) -> bool | None:
        return None  # close: a server that stops sending has ended the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self.error is None:
            reason = "EOF" if exc is None else str(exc) or type(exc).__name__
            self.error = RpcError(grpc.StatusCode.UNAVAILABLE, f"error reading from server: {reason}")
        for stream in list(self._streams.values()):
            unary = stream.future is not None and self._unary_error is not None
            self._finish(stream, self._unary_error if unary else self.error)
        self._wake_slots()
        if self._on_lost is not None:
            self._on_lost(self)

    # -- calls ---------------------------------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """New calls may start here (once a slot is free)."""
        return self._transport is not None and not self._draining

    @property
    def takes_call(self) -> bool:
        """A call may start here now: usable, and under the server's stream limit."""
        return self.usable and self.has_slot()

    def has_slot(self) -> bool:
        return self._peer_max_streams is None or len(self._streams) < self._peer_max_streams

    def wait_slot(self) -> asyncio.Future[None]:
        """Resolves when a stream ends, the server's limit changes, or the connection stops taking calls."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        return waiter

    def start(self, block: bytes, message: bytes, future: asyncio.Future[bytes] | None) -> Stream:
        """Open a stream and send the request (HEADERS, then the message with END_STREAM, as far as the flow-control
        windows allow; the rest follows as the server opens them). `takes_call` must hold."""
        transport = self._transport
        assert transport is not None and not self._draining
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id > h2.STREAM_ID_MASK:
            self._draining = True  # ids used up: later calls open a new connection
        stream = Stream(stream_id, future, self._peer_stream_window)
        self._streams[stream_id] = stream
        headers = h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, block)
        size = len(message) + 5
        if size <= self._peer_max_frame and size <= self._send_window and size <= stream.send_window:
            self._send_window -= size
            stream.send_window -= size
            data = h2.HEADER.pack(size << 8 | h2.DATA, h2.END_STREAM, stream_id)
            transport.write(b"".join((headers, data, b"\0", (size - 5).to_bytes(4, "big"), message)))
        else:
            transport.write(headers)
            stream.pending = memoryview(b"\0" + (size - 5).to_bytes(4, "big") + message)
            self._blocked.append(stream)
            self._flush_blocked()
        return stream

    def cancel(self, stream: Stream, error: RpcError) -> None:
        """End a call from our side (deadline, cancellation): RST_STREAM(CANCEL) and fail it with `error`."""
        if stream.done:
            return
        self._write(h2.rst_stream(stream.id, h2.CANCEL))
        self._finish(stream, error)

    def take(self, stream: Stream) -> bytes | None:
        """The next message of a streaming call, or None if none has arrived yet (opens its window again as its
        messages are read)."""
        if not stream.messages:
            return None
        message = stream.messages.popleft()
        stream.buffered -= len(message)
        self._replenish(stream)
        return message

    def close(self, error: RpcError, unary_error: RpcError | None = None) -> None:
        """Close the connection; every call on it fails with `error`, unary calls in flight with `unary_error` if
        given."""
        if self.error is None:
            self.error = error
            self._unary_error = unary_error
        self._draining = True
        if self._transport is not None:
            self._transport.close()

    # -- frames --------------------------------------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and kind != h2.CONTINUATION:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "expected a CONTINUATION frame")
        try:
            if kind == h2.DATA:
                self._data(flags, stream_id, payload)
            elif kind == h2.HEADERS:
                self._headers(flags, stream_id, payload)
            elif kind == h2.CONTINUATION:
                self._continuation(flags, stream_id, payload)
            elif kind == h2.SETTINGS:
                self._settings(flags, stream_id, payload)
            elif kind == h2.WINDOW_UPDATE:
                self._window_update(stream_id, payload)
            elif kind == h2.PING:
                self._ping(flags, stream_id, payload)
            elif kind == h2.RST_STREAM:
                self._rst_stream(stream_id, payload)
            elif kind == h2.GOAWAY:
                self._goaway(stream_id, payload)
            elif kind == h2.PUSH_PROMISE:
                raise ConnectionFailure(h2.PROTOCOL_ERROR, "PUSH_PROMISE, although push is disabled")
            # PRIORITY and unknown frame types are ignored (RFC 9113 §4.1, §5.3.2).
        except StreamFailure as failure:
            stream = self._streams.get(stream_id)
            if stream is not None:
                self._write(h2.rst_stream(stream_id, failure.code))
                self._finish(stream, failure.error)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self._recv_window -= length
        if self._recv_window < 0:
            raise ConnectionFailure(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_unacked += length
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._write(h2.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # a stream we reset or that ended: only the connection's window counts it
        stream.recv_window -= length
        if stream.recv_window < 0:
            raise StreamFailure(self._internal("DATA beyond the stream window"), h2.FLOW_CONTROL_ERROR)
        if stream.http_status is None:
            raise StreamFailure(self._internal("DATA before the response headers"))
        if flags & h2.PADDED:
            payload = _unpad(payload)
        self._messages(stream, payload)
        if flags & h2.END_STREAM:
            raise StreamFailure(self._internal("server closed the stream without sending trailers"))
        if stream.future is None:
            stream.recv_unacked += length
            self._replenish(stream)

    def _messages(self, stream: Stream, data: bytes) -> None:
        """Split gRPC's length-prefixed messages out of DATA payloads."""
        buffer = stream.buffer
        if not buffer and len(data) >= 5 and data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5:
            self._deliver(stream, data[5:])  # the common case: one whole message in one frame
            return
        buffer += data
        while len(buffer) >= 5:
            if buffer[0] != 0:
                # Compression is never offered (no grpc-accept-encoding), so a compressed message is a broken peer.
                raise StreamFailure(self._internal("grpc: compressed flag set, but no compression was negotiated"))
            size = int.from_bytes(buffer[1:5], "big")
            if size > self._max_message:
                error = RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"grpc: received message larger than max ({size} vs. {self._max_message})",
                )
                raise StreamFailure(error, h2.CANCEL)
            if len(buffer) < 5 + size:
                return
            message = bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            self._deliver(stream, message)

    def _deliver(self, stream: Stream, message: bytes) -> None:
        if stream.future is not None:
            if stream.response is not None:
                raise StreamFailure(
                    self._internal("cardinality violation: expected <EOF> for non server-streaming RPCs, but received "
                                   "another message")
                )  # fmt: skip
            stream.response = message
            return
        stream.messages.append(message)
        stream.buffered += len(message)
        _wake(stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & h2.PADDED:
            payload = _unpad(payload)
        if flags & h2.PRIORITY_FLAG:
            if len(payload) < 5:
                raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            payload = payload[5:]
        end_stream = bool(flags & h2.END_STREAM)
        if flags & h2.END_HEADERS:
            self._header_block(stream_id, payload, end_stream)
        else:
            self._block = bytearray(payload)
            self._block_stream = stream_id
            self._block_end_stream = end_stream

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._block
        if block is None or stream_id != self._block_stream:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
        block += payload
        if len(block) > MAX_HEADER_LIST:
            raise ConnectionFailure(h2.ENHANCE_YOUR_CALM, f"header block larger than {MAX_HEADER_LIST} bytes")
        if flags & h2.END_HEADERS:
            self._block = None
            self._header_block(stream_id, bytes(block), self._block_end_stream)

    def _header_block(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        try:
            headers = self._decoder.decode(block)  # always, even for a stream we no longer follow: HPACK state
        except HeaderDecodeError as err:
            raise ConnectionFailure(h2.COMPRESSION_ERROR, f"hpack: {err}") from None
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if stream.http_status is None:  # the response headers (or all of a trailers-only response)
            stream.http_status = next((value for name, value in headers if name == ":status"), "")
            if stream.http_status != "200" and not (end_stream and _has_grpc_status(headers)):
                raise StreamFailure(http_status_error(stream.http_status or "missing"), h2.CANCEL)
            content_type = next((value for name, value in headers if name == "content-type"), "")
            if not end_stream and not content_type.startswith("application/grpc"):
                raise StreamFailure(
                    RpcError(grpc.StatusCode.UNKNOWN, f"unexpected content-type {content_type!r} from the server"),
                    h2.CANCEL,
                )
            if not end_stream:
                return
        elif not end_stream:
            raise StreamFailure(self._internal("trailers without END_STREAM"))
        self._finish(stream, self._status(stream, headers))

    def _status(self, stream: Stream, trailers: tuple[tuple[str, str], ...]) -> RpcError | None:
        """The call's outcome from its trailers: None for OK with what an OK call must have received."""
        code: grpc.StatusCode | None = None
        message = ""
        for name, value in trailers:
            if name == "grpc-status":
                code = status_code(value)
            elif name == "grpc-message":
                message = grpc_message(value)
        if code is None:
            return RpcError(grpc.StatusCode.UNKNOWN, "server closed the stream without sending grpc-status")
        if code != grpc.StatusCode.OK:
            return RpcError(code, message, trailing_metadata(trailers))
        if stream.buffer:
            return self._internal("server ended the stream in the middle of a message")
        if stream.future is not None and stream.response is None:
            return self._internal("cardinality violation: received no response message from non-streaming RPC")
        return None

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6 bytes")
        for key, value in h2.parse_settings(payload):
            if key == h2.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise ConnectionFailure(h2.FLOW_CONTROL_ERROR, f"initial window size {value} too large")
                delta = value - self._peer_stream_window
                self._peer_stream_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > h2.MAX_WINDOW:
                        raise ConnectionFailure(h2.FLOW_CONTROL_ERROR, "stream window overflow")
            elif key == h2.SETTINGS_MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.LARGEST_MAX_FRAME:
                    raise ConnectionFailure(h2.PROTOCOL_ERROR, f"invalid max frame size {value}")
                self._peer_max_frame = value
            elif key == h2.SETTINGS_MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
            elif key == h2.SETTINGS_ENABLE_PUSH and value > 1:
                raise ConnectionFailure(h2.PROTOCOL_ERROR, f"invalid enable push {value}")
            # HEADER_TABLE_SIZE and MAX_HEADER_LIST_SIZE bind our encoder, which never indexes and sends ~150 bytes.
        self._write(_SETTINGS_ACK)
        self._flush_blocked()
        self._wake_slots()
        if self._on_handshake is not None:
            self._on_handshake()
            self._on_handshake = None

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = h2.u32(payload) & h2.MAX_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise ConnectionFailure(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > h2.MAX_WINDOW:
                raise ConnectionFailure(h2.FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            if increment == 0:
                raise StreamFailure(self._internal("WINDOW_UPDATE of 0"))
            stream.send_window += increment
            if stream.send_window > h2.MAX_WINDOW:
                raise StreamFailure(self._internal("stream window overflow"), h2.FLOW_CONTROL_ERROR)
        self._flush_blocked()

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & h2.ACK:
            self._write(h2.frame(h2.PING, h2.ACK, 0, payload))

    def _rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        code = h2.u32(payload)
        message = f"stream terminated by RST_STREAM with error code: {h2.error_name(code)}"
        if code == h2.REFUSED_STREAM:
            self._finish(stream, UnprocessedError(message))
        else:
            self._finish(stream, RpcError(_RST_CODES.get(code, grpc.StatusCode.INTERNAL), message))

    def _goaway(self, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ConnectionFailure(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise ConnectionFailure(h2.FRAME_SIZE_ERROR, "GOAWAY too short")
        last = h2.u32(payload) & h2.STREAM_ID_MASK
        code = h2.u32(payload, 4)
        self._draining = True
        self.goaway = f"code: {h2.error_name(code)}, debug data: {go_quoted(payload[8:200])}"
        if code != h2.NO_ERROR:
            log.warning(
                "gRPC server sent GOAWAY",
                extra={"code": h2.error_name(code), "debug": payload[8:200].decode("latin-1")},
            )
        unprocessed = UnprocessedError(f"the server is going away (GOAWAY {h2.error_name(code)}) and did not take "
                                       "the call")  # fmt: skip
        for stream in [s for s in self._streams.values() if s.id > last]:
            self._finish(stream, unprocessed)
        self._wake_slots()  # waiters go elsewhere
        self._close_if_drained()

    # -- bookkeeping -------------------------------------------------------------------------------------------------

    def _finish(self, stream: Stream, error: RpcError | None) -> None:
        if stream.done:
            return
        stream.done = True
        stream.error = error
        self._streams.pop(stream.id, None)
        if stream.pending:
            stream.pending = memoryview(b"")
            self._blocked.remove(stream)
            if error is None:  # the server answered before reading all of the request: stop sending it
                self._write(h2.rst_stream(stream.id, h2.NO_ERROR))
        future = stream.future
        if future is None:
            _wake(stream)
        elif not future.done():
            if error is None:
                assert stream.response is not None
                future.set_result(stream.response)
            else:
                future.set_exception(error)
        while self._slot_waiters:  # one stream ended: one waiter may start (all of them, were it a herd)
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        """A draining connection closes once its last stream has ended."""
        if self._draining and not self._streams and self._transport is not None:
            self._transport.close()

    def _replenish(self, stream: Stream) -> None:
        """Open a streaming call's window again once half of it is used, unless its reader has fallen behind."""
        if stream.recv_unacked >= STREAM_WINDOW // 2 and stream.buffered < MAX_BUFFERED and not stream.done:
            self._write(h2.window_update(stream.id, stream.recv_unacked))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    def _flush_blocked(self) -> None:
        """Send request bytes that were waiting for window, oldest stream first."""
        if not self._blocked or self._transport is None:
            return
        out: list[bytes] = []
        for stream in list(self._blocked):
            while stream.pending and stream.send_window > 0 and self._send_window > 0:
                size = min(len(stream.pending), stream.send_window, self._send_window, self._peer_max_frame)
                chunk, stream.pending = stream.pending[:size], stream.pending[size:]
                stream.send_window -= size
                self._send_window -= size
                out.append(h2.frame(h2.DATA, 0 if stream.pending else h2.END_STREAM, stream.id, bytes(chunk)))
            if not stream.pending:
                self._blocked.remove(stream)
            if self._send_window <= 0:
                break
        if out:
            self._send_data(b"".join(out))

    def _write(self, data: bytes) -> None:
        """A frame the peer's frames made us send (ACKs, window updates, resets): bounded by MAX_WRITE_BACKLOG, so a
        server that makes us answer without reading cannot grow our buffer."""
        if self._transport is not None:
            self._transport.write(data)
            self._check_backlog()

    def _send_data(self, data: bytes) -> None:
        """Request bytes: bounded by the server's own flow-control windows, which may exceed MAX_WRITE_BACKLOG."""
        if self._transport is not None:
            self._transport.write(data)

    def _check_backlog(self) -> None:
        transport = self._transport
        if transport is not None and transport.get_write_buffer_size() > MAX_WRITE_BACKLOG:
            self._fail(h2.ENHANCE_YOUR_CALM, "the server stopped reading")

    def _wake_slots(self) -> None:
        waiters, self._slot_waiters = self._slot_waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, code: int, message: str) -> None:
        """A connection error: tell the server why, then fail every call on the connection."""
        log.warning("gRPC connection error", extra={"code": h2.error_name(code), "error": message})
        self.error = RpcError(grpc.StatusCode.INTERNAL, f"connection error: {message}")
        if self._transport is not None:
            self._transport.write(h2.goaway(0, code, message.encode()[:200]))
        self.close(self.error)

    @staticmethod
    def _internal(message: str) -> RpcError:
        return RpcError(grpc.StatusCode.INTERNAL, message)


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise ConnectionFailure(h2.PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ConnectionFailure(h2.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]


def _has_grpc_status(headers: tuple[tuple[str, str], ...]) -> bool:
    return any(name == "grpc-status" for name, _ in headers)


def _wake(stream: Stream) -> None:
    waiter = stream.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
