"""Fuzzing the agent's lean gRPC client (deviceplane.lean_grpc) with a hostile HTTP/2 server: frames of every type
with random flags, stream ids and payloads, valid and broken header blocks, gRPC messages whose prefixes lie,
SETTINGS and WINDOW_UPDATEs out of range, garbage, cut at random points, with or without closing.

Whatever the server sends, a call ends within its deadline (plus a little), as its response bytes or an `RpcError`,
never another exception; a streaming call ends the same way or is still waiting when the server neither ends nor
closes it (it has no deadline, as the kubelet's ListAndWatch); nothing is left running after the channel is closed.

The server is a raw socket server in this process: a real gRPC server cannot be made to send these bytes, which is
the fault this test is about (the client's behaviour against real servers: tests/integration/test_lean_grpc.py).
"""

from __future__ import annotations

import asyncio
import struct
import tempfile
from pathlib import Path

import hpack
from hypothesis import event, given
from hypothesis import strategies as st

from deviceplane.lean_grpc import Channel, RpcError
from deviceplane.lean_grpc import frames as h2
from tests.support.fuzz import fuzz_settings

DEADLINE = 0.5
SLACK = 1.0

HEADER_SETS = st.sampled_from(
    [
        [(":status", "200"), ("content-type", "application/grpc")],
        [(":status", "200"), ("content-type", "application/grpc+proto"), ("x-extra", "v" * 300)],
        [(":status", "404"), ("content-type", "text/html")],
        [(":status", "200"), ("content-type", "text/plain")],
        [(":status", "abc")],
        [("content-type", "application/grpc")],
        [(":status", "200"), ("grpc-status", "0")],
        [(":status", "200"), ("grpc-status", "13"), ("grpc-message", "bad%20thing%ZZ")],
        [("grpc-status", "0")],
        [("grpc-status", "2"), ("grpc-message", "unknown \u00e9")],
        [("grpc-status", "99")],
        [("grpc-status", "x"), ("grpc-message", "")],
        [("grpc-message", "no status")],
    ]
)


@st.composite
def header_block(draw: st.DrawFn, encoder: hpack.Encoder) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))  # not HPACK at all
    headers = draw(HEADER_SETS)
    return bytes(encoder.encode(headers, huffman=draw(st.booleans())))


@st.composite
def grpc_message(draw: st.DrawFn) -> bytes:
    body = draw(st.binary(max_size=64))
    declared = draw(st.sampled_from([len(body), len(body), len(body) + 3, max(0, len(body) - 1), 5 << 20, 0xFFFFFFFF]))
    flag = draw(st.sampled_from([0, 0, 0, 1, 2]))
    return bytes((flag,)) + struct.pack(">I", declared) + body


@st.composite
def frame(draw: st.DrawFn, encoder: hpack.Encoder) -> bytes:
    kinds = [h2.DATA, h2.HEADERS, h2.HEADERS, h2.CONTINUATION, h2.SETTINGS, h2.WINDOW_UPDATE, h2.PING,
             h2.RST_STREAM, h2.GOAWAY, h2.PUSH_PROMISE, h2.PRIORITY, 0xA, 0xFF]  # fmt: skip
    kind = draw(st.sampled_from(kinds))
    stream_id = draw(st.sampled_from([1, 1, 1, 3, 0, 2, 0x7FFFFFFF]))
    flags = draw(st.sampled_from([0, h2.END_STREAM, h2.END_HEADERS, h2.END_HEADERS | h2.END_STREAM, h2.PADDED,
                                  h2.PRIORITY_FLAG | h2.END_HEADERS, 0xFF]))  # fmt: skip
    if kind in (h2.HEADERS, h2.CONTINUATION):
        payload = draw(header_block(encoder))
    elif kind == h2.DATA:
        payload = draw(st.one_of(grpc_message(), st.binary(max_size=30)))
    elif kind == h2.SETTINGS:
        pairs = draw(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 0xFFFFFFFF)), max_size=4))
        payload = b"".join(struct.pack(">HI", key, value) for key, value in pairs) + draw(st.binary(max_size=2))
    elif kind in (h2.WINDOW_UPDATE, h2.RST_STREAM):
        payload = struct.pack(">I", draw(st.integers(0, 0xFFFFFFFF)))[: draw(st.sampled_from([4, 4, 3, 0]))]
    elif kind == h2.GOAWAY:
        payload = struct.pack(">II", draw(st.integers(0, 5)), draw(st.integers(0, 13))) + draw(st.binary(max_size=8))
    else:
        payload = draw(st.binary(max_size=20))
    if flags & h2.PADDED and payload:
        payload = bytes((draw(st.integers(0, 255)),)) + payload
    length = len(payload) if draw(st.integers(0, 19)) else draw(st.sampled_from([0, 1, 1 << 16, (1 << 24) - 1]))
    return struct.pack(">I", length << 8 | kind)[1:] + struct.pack(">BI", flags, stream_id) + payload


@st.composite
def script(draw: st.DrawFn) -> tuple[list[bytes], bool]:
    encoder = hpack.Encoder()
    parts: list[bytes] = []
    if draw(st.booleans()):
        parts.append(h2.settings({}))  # a well-behaved start
    parts += draw(st.lists(st.one_of(frame(encoder), st.binary(min_size=1, max_size=12)), max_size=12))
    return parts, draw(st.booleans())


async def serve(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    parts: list[bytes],
    close: bool,
    handlers: list[asyncio.Task[None]],
) -> None:
    task = asyncio.current_task()
    assert task is not None
    handlers.append(task)
    try:
        await reader.readexactly(len(h2.PREFACE))
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0)
        if close:
            writer.close()
        else:
            await asyncio.sleep(DEADLINE + SLACK)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def run(parts: list[bytes], close: bool, streaming: bool) -> str:
    with tempfile.TemporaryDirectory(prefix="dp-lg-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "s.sock")
        handlers: list[asyncio.Task[None]] = []
        server = await asyncio.start_unix_server(lambda r, w: serve(r, w, parts, close, handlers), path)
        channel = Channel(path)
        before = asyncio.all_tasks()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if streaming:
                try:
                    async with asyncio.timeout(DEADLINE + SLACK / 2):
                        received = [message async for message in channel.stream("/peer.Test/Stream", b"{}")]
                    outcome = f"stream ended with {len(received)} messages"
                except RpcError as err:
                    outcome = f"stream failed {err.code().name}"
                except TimeoutError:
                    outcome = "stream still waiting"
            else:
                try:
                    await channel.unary("/peer.Test/Echo", b"hello", DEADLINE)
                    outcome = "unary answered"
                except RpcError as err:
                    outcome = f"unary failed {err.code().name}"
                assert loop.time() - started < DEADLINE + SLACK
        finally:
            await channel.close()
            server.close()
            for handler in handlers:  # the fake server's side; only the client's tasks are checked below
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await server.wait_closed()
        await asyncio.sleep(0)
        assert asyncio.all_tasks() - before <= {asyncio.current_task()}
        return outcome


@fuzz_settings(bounded=150, long=20_000)
@given(script(), st.booleans())
def test_hostile_server_never_breaks_a_call(case: tuple[list[bytes], bool], streaming: bool) -> None:
    parts, close = case
    event(asyncio.run(run(parts, close, streaming)))
