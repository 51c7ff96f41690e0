"""A gRPC server process (grpc.aio, C-core's HTTP/2) for the lean client's tests: `/peer.Test/<Method>`, wire
bytes in and out, behaviour chosen by the method.

    python -m tests.support.grpc_peer SOCKET [--max-concurrent-streams N] [--max-connection-age-ms MS]

    Echo        the request, as it came
    Size        a response of N bytes (N: the request as a decimal number), filled with a repeating pattern
    Length      the request's length, as a decimal number (big requests: flow control on the client's side)
    Fail        aborts with the code and message in the request (JSON {"code": int, "message": str})
    Hang        never answers; counts the calls the client cancelled (see Stats)
    Slow        answers b"done" after the number of seconds in the request
    Stream      server-streaming: JSON {"count": k, "size": s} -> k messages of s bytes, message i filled with i % 251
    Forever     server-streaming: one message, then waits (the client ends it); counts cancellations too
    Stats       JSON {"cancelled": n, "calls": {method: n}}

Prints "ready" on stdout once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

SERVICE = "peer.Test"
calls: Counter[str] = Counter()
cancelled = 0


def pattern(size: int, seed: int = 0) -> bytes:
    block = bytes((seed + i) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


async def _hang_until_cancelled(context: Any) -> None:
    global cancelled
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled += 1
        raise


def unary(name: str, answer: Callable[[bytes, Any], Awaitable[bytes]]) -> grpc.RpcMethodHandler[bytes, bytes]:
    async def handle(request: bytes, context: Any) -> bytes:
        calls[name] += 1
        return await answer(request, context)

    return grpc.unary_unary_rpc_method_handler(handle)


async def echo(request: bytes, _context: Any) -> bytes:
    return request


async def size(request: bytes, _context: Any) -> bytes:
    return pattern(int(request))


async def length(request: bytes, _context: Any) -> bytes:
    return str(len(request)).encode()


async def fail(request: bytes, context: Any) -> bytes:
    spec = json.loads(request)
    code = next(c for c in grpc.StatusCode if c.value[0] == spec["code"])
    await context.abort(code, spec["message"])
    raise AssertionError("unreachable")


async def hang(_request: bytes, context: Any) -> bytes:
    await _hang_until_cancelled(context)
    raise AssertionError("unreachable")


async def slow(request: bytes, _context: Any) -> bytes:
    await asyncio.sleep(float(request))
    return b"done"


async def stats(_request: bytes, _context: Any) -> bytes:
    return json.dumps({"cancelled": cancelled, "calls": dict(calls)}).encode()


async def stream(request: bytes, _context: Any) -> AsyncIterator[bytes]:
    calls["Stream"] += 1
    spec = json.loads(request)
    for i in range(spec["count"]):
        yield pattern(spec["size"], i)


async def forever(_request: bytes, context: Any) -> AsyncIterator[bytes]:
    calls["Forever"] += 1
    yield b"first"
    await _hang_until_cancelled(context)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("--max-concurrent-streams", type=int)
    parser.add_argument("--max-connection-age-ms", type=int, help="GOAWAY each connection this old (calls may finish)")
    args = parser.parse_args()
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    if args.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", args.max_concurrent_streams))
    if args.max_connection_age_ms:
        options.append(("grpc.max_connection_age_ms", args.max_connection_age_ms))
        options.append(("grpc.max_connection_age_grace_ms", 10_000))
    server = grpc.aio.server(options=options)
    handlers = {
        name: unary(name, answer)
        for name, answer in {
            "Echo": echo, "Size": size, "Length": length, "Fail": fail, "Hang": hang, "Slow": slow,
            "Stats": stats,
        }.items()
    }  # fmt: skip
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(stream)
    handlers["Forever"] = grpc.unary_stream_rpc_method_handler(forever)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    server.add_insecure_port(f"unix://{args.socket}")
    await server.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await server.stop(1)


if __name__ == "__main__":
    asyncio.run(main())
