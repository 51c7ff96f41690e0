"""Fuzzing how serving/lean_http.py sends answers: pipelined requests for answers of every size (small, joined to
their head; large, handed over in views of their pieces while the transport takes them), HEAD among them, a
`Connection: close` anywhere, the client reading at once or only after a while, half-closing or not. Every answer
must arrive whole, framed by its Content-Length, in the order asked, none after the one that closes; nothing may
fail inside the event loop (a callback raising is logged by asyncio, not by us: it is collected here)."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from deviceplane.agent.serving.lean_http import LeanHttpServer, Request, Respond
from tests.support.fuzz import fuzz_settings
from tests.support.raw_http import responses

# Sizes around the joining limit (64 KiB) and the chunk (256 KiB), and one more than the socket buffers take at once.
SIZES = st.sampled_from([0, 1, 100, 65_536, 65_537, 262_144, 262_145, 600_000, 3 << 20])
PIECES = st.lists(SIZES, min_size=1, max_size=3)
REQUEST = st.tuples(st.sampled_from(["GET", "GET", "HEAD"]), PIECES, st.booleans())  # (method, body pieces, close)


def body_of(index: int, sizes: list[int]) -> tuple[bytes, ...]:
    """The answer to request `index`: pieces of the given sizes, each filled with a byte naming the request."""
    fill = bytes([65 + index % 26])
    return (b"%d:" % index, *(fill * size for size in sizes))


@fuzz_settings(bounded=60, long=2_000)
@given(
    st.lists(REQUEST, min_size=1, max_size=5),
    st.sampled_from([0.0, 0.0, 0.05, 0.3]),
    st.booleans(),
    st.sampled_from([1, 7, 1 << 16]),
)
# Found by this test (under a mutation that made it likelier): the client's EOF read before a large answer went out,
# the connection closed from inside `resume_writing`, and asyncio reported the connection lost twice.
@example([("GET", [3 << 20, 3 << 20, 1], False)], 0.0, True, 1)
# A pipelined request waiting behind an answer larger than the socket buffers: handled once that answer is out.
@example([("GET", [3 << 20, 3 << 20], False), ("GET", [1], False)], 0.0, False, 1 << 16)
def test_fuzz_answers_arrive_whole_in_order(
    requests: list[tuple[str, list[int], bool]], read_after: float, half_close: bool, piece: int
) -> None:
    problems: list[str] = []

    async def scenario() -> bytes:
        loop = asyncio.get_running_loop()

        def collect(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            problems.append(str(context.get("exception") or context.get("message")))

        loop.set_exception_handler(collect)
        index = iter(range(len(requests)))

        def answer(_request: Request, respond: Respond) -> None:
            i = next(index)
            respond(200, body_of(i, requests[i][1]), b"text/plain")

        server = LeanHttpServer({("GET", "/a"): answer})
        await server.start("127.0.0.1:0")
        try:
            sent = b"".join(
                f"{method} /a HTTP/1.1\r\n".encode() + (b"Connection: close\r\n" if close else b"") + b"\r\n"
                for method, _sizes, close in requests
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for start in range(0, len(sent), piece):
                writer.write(sent[start : start + piece])
                await writer.drain()
            if half_close:
                writer.write_eof()
            await asyncio.sleep(read_after)
            if not half_close and not any(close for _m, _s, close in requests):
                received = b""
                for method, _sizes, _close in requests:  # the server keeps the connection: read what was asked
                    received += await read_one(reader, method == "HEAD")
            else:
                received = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return received
        finally:
            await server.close()

    received = asyncio.run(scenario())
    assert problems == []
    answered = responses(received)
    last = next((i for i, (_m, _s, close) in enumerate(requests) if close), len(requests) - 1)
    assert len(answered) == last + 1, [(status, len(body)) for status, _f, body in answered]
    for i, (status, fields, body) in enumerate(answered):
        method, sizes, _close = requests[i]
        whole = b"".join(body_of(i, sizes))
        assert status == 200 and int(fields[b"content-length"]) == len(whole)
        assert body == (b"" if method == "HEAD" else whole), (i, method, len(body), len(whole))


async def read_one(reader: asyncio.StreamReader, head_only: bool) -> bytes:
    """One answer: its head, then as many bytes as its Content-Length (none after HEAD)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    length = 0 if head_only else int(fields[b"Content-Length"])
    return head + (await asyncio.wait_for(reader.readexactly(length), 30) if length else b"")
