"""The agent's lean gRPC client (deviceplane.lean_grpc) against a real gRPC server process (grpc.aio on C-core's
HTTP/2, tests/support/grpc_peer.py) over a real unix socket: statuses, deadlines, cancellation, flow control both
ways, the message limit, streams, the server's stream limit, GOAWAY and reconnection. Its use against grpc-go servers
is covered by the agent's tests with the upstream sample-device-plugin and generic-device-plugin (tests/e2e)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deviceplane.lean_grpc import Channel, RpcError
from tests.support.grpc_peer import pattern
from tests.support.procs import ROOT, child_env


class Peer:
    def __init__(self, socket: Path, *flags: str) -> None:
        self.socket = socket
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.grpc_peer", str(socket), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=child_env(),
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == b"ready"

    def graceful_stop(self) -> None:
        """Close stdin: the server stops with a 1 s grace (GOAWAY, calls in flight may finish)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.socket.unlink(missing_ok=True)


@pytest.fixture
def peer(short_tmp: Path) -> Iterator[Peer]:
    started = Peer(short_tmp / "peer.sock")
    yield started
    started.kill()


def method(name: str) -> str:
    return f"/peer.Test/{name}"


async def stats(channel: Channel) -> dict[str, object]:
    return dict(json.loads(await channel.unary(method("Stats"), b"", 5)))


async def server_saw_cancellations(channel: Channel, count: int) -> None:
    """The server's handlers were cancelled (it got RST_STREAM), not left running: polled for up to 2 s."""
    for _ in range(100):
        if (await stats(channel))["cancelled"] == count:
            return
        await asyncio.sleep(0.02)
    assert (await stats(channel))["cancelled"] == count


async def test_unary_calls_carry_bytes_both_ways(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        assert await channel.unary(method("Echo"), b"", 5) == b""
        assert await channel.unary(method("Echo"), b"\x00\xffbytes", 5) == b"\x00\xffbytes"
        # 10 MiB out: more than the server's stream window (4 MiB) and the connection's first 64 KiB, in frames no
        # larger than it allows: the request waits for WINDOW_UPDATEs.
        big = pattern(10 << 20)
        assert await channel.unary(method("Length"), big, 30) == str(len(big)).encode()
        assert await channel.unary(method("Size"), b"3000000", 10) == pattern(3_000_000)
        # Many calls at once on the one connection, each answer to its own call.
        payloads = [f"call-{i}".encode() * (i % 7 + 1) for i in range(300)]
        assert await asyncio.gather(*(channel.unary(method("Echo"), p, 10) for p in payloads)) == payloads
    finally:
        await channel.close()


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (grpc.StatusCode.UNKNOWN, "out of sim juice"),
        (grpc.StatusCode.INVALID_ARGUMENT, "ünïcödé ✓ 100% sure\nsecond line"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (grpc.StatusCode.PERMISSION_DENIED, "%41 stays as typed"),
    ],
)
async def test_error_statuses_arrive_exactly(peer: Peer, code: grpc.StatusCode, message: str) -> None:
    channel = Channel(str(peer.socket))
    try:
        with pytest.raises(RpcError) as info:
            await channel.unary(method("Fail"), json.dumps({"code": code.value[0], "message": message}).encode(), 5)
        assert (info.value.code(), info.value.details()) == (code, message)
        with pytest.raises(RpcError) as missing:
            await channel.unary("/peer.Test/NoSuchMethod", b"", 5)
        assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert await channel.unary(method("Echo"), b"still fine", 5) == b"still fine"
    finally:
        await channel.close()


async def test_deadline_ends_the_call_and_the_server_hears_of_it(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        started = time.monotonic()
        with pytest.raises(RpcError) as info:
            await channel.unary(method("Hang"), b"", 0.3)
        elapsed = time.monotonic() - started
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "context deadline exceeded",
        )
        assert 0.3 <= elapsed < 1.5
        await server_saw_cancellations(channel, 1)
    finally:
        await channel.close()


async def test_cancelled_caller_cancels_the_call(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        call = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await server_saw_cancellations(channel, 1)
    finally:
        await channel.close()


async def test_message_limit_is_grpcs_4_mib(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        assert len(await channel.unary(method("Size"), str(4 << 20).encode(), 10)) == 4 << 20
        with pytest.raises(RpcError) as info:
            await channel.unary(method("Size"), str((4 << 20) + 1).encode(), 10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "grpc: received message larger than max (4194305 vs. 4194304)"
        assert await channel.unary(method("Echo"), b"after", 5) == b"after"  # the connection is fine
    finally:
        await channel.close()


async def test_stream_delivers_every_message_past_the_windows(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        # 80 MiB: past the stream's 8 MiB window and the connection's 64 MiB, so both are topped up as it is read.
        received = [
            m async for m in channel.stream(method("Stream"), json.dumps({"count": 40, "size": 2 << 20}).encode())
        ]
        assert len(received) == 40
        assert all(message == pattern(2 << 20, i) for i, message in enumerate(received))
        assert [m async for m in channel.stream(method("Stream"), b'{"count": 0, "size": 1}')] == []
    finally:
        await channel.close()


async def test_stream_cancelled_from_this_side(peer: Peer) -> None:
    channel = Channel(str(peer.socket))
    try:
        stream = channel.stream(method("Forever"), b"")
        assert await stream.__anext__() == b"first"
        stream.cancel()
        with pytest.raises(RpcError) as info:
            await stream.__anext__()
        assert info.value.code() == grpc.StatusCode.CANCELLED
        await server_saw_cancellations(channel, 1)
    finally:
        await channel.close()


async def test_the_servers_stream_limit_queues_calls(short_tmp: Path) -> None:
    peer = Peer(short_tmp / "limited.sock", "--max-concurrent-streams", "4")
    channel = Channel(str(peer.socket))
    try:
        await channel.unary(method("Echo"), b"", 5)  # the server's SETTINGS (the limit) are in after this
        payloads = [str(i).encode() for i in range(200)]
        slow = [channel.unary(method("Slow"), b"0.05", 10) for _ in range(8)]
        results = await asyncio.gather(*slow, *(channel.unary(method("Echo"), p, 10) for p in payloads))
        assert results == [b"done"] * 8 + payloads
    finally:
        await channel.close()
        peer.kill()


async def test_goaway_lets_calls_in_flight_finish_and_later_calls_redial(short_tmp: Path) -> None:
    path = short_tmp / "goaway.sock"
    peer = Peer(path)
    channel = Channel(str(path))
    try:
        assert await channel.unary(method("Echo"), b"x", 5) == b"x"
        slow = asyncio.create_task(channel.unary(method("Slow"), b"0.5", 10))
        await asyncio.sleep(0.1)
        peer.graceful_stop()  # GOAWAY; the call in flight has a second to finish
        assert await slow == b"done"
        await asyncio.to_thread(peer.proc.wait, 10)
        with pytest.raises(RpcError) as info:
            await channel.unary(method("Echo"), b"x", 5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"dial unix {path}: connect:" in info.value.details()
        # The same path served again: the next call dials a new connection.
        peer.kill()
        peer = Peer(path)
        assert await channel.unary(method("Echo"), b"back", 5) == b"back"
    finally:
        await channel.close()
        peer.kill()


async def test_killed_server_fails_calls_in_flight_and_the_channel_recovers(short_tmp: Path) -> None:
    path = short_tmp / "killed.sock"
    peer = Peer(path)
    channel = Channel(str(path))
    try:
        hung = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
        await asyncio.sleep(0.2)
        peer.kill()
        with pytest.raises(RpcError) as info:
            await hung
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith("error reading from server")
        peer = Peer(path)
        assert await channel.unary(method("Echo"), b"again", 5) == b"again"
    finally:
        await channel.close()
        peer.kill()


async def test_dial_errors_and_wait_for_ready(short_tmp: Path) -> None:
    path = short_tmp / "later.sock"
    channel = Channel(str(path))
    try:
        with pytest.raises(RpcError) as info:
            await channel.unary(method("Echo"), b"", 5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == (
            f'connection error: desc = "transport: Error while dialing: dial unix {path}: connect: '
            'no such file or directory"'
        )
        started = time.monotonic()
        with pytest.raises(RpcError) as waited:
            await channel.unary(method("Echo"), b"", 0.3, wait_for_ready=True)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.3 <= time.monotonic() - started < 1.5
        assert not channel.connected_once
        # wait_for_ready: a server that appears while the call waits gets it.
        call = asyncio.create_task(channel.unary(method("Echo"), b"hello", 10, wait_for_ready=True))
        await asyncio.sleep(0.3)
        peer = Peer(path)
        try:
            assert await call == b"hello"
            assert channel.connected_once
        finally:
            peer.kill()
    finally:
        await channel.close()


async def test_close_fails_what_is_in_flight_and_leaves_nothing_behind(peer: Peer) -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    tasks_before = asyncio.all_tasks()
    channel = Channel(str(peer.socket))
    await channel.unary(method("Echo"), b"", 5)
    stream = channel.stream(method("Forever"), b"")
    assert await stream.__anext__() == b"first"
    hung = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
    await asyncio.sleep(0.1)
    await channel.close()
    with pytest.raises(RpcError) as info:
        await hung
    assert info.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(RpcError):
        await stream.__anext__()
    with pytest.raises(RpcError):
        await channel.unary(method("Echo"), b"", 5)
    await asyncio.sleep(0.05)  # the transport's close callbacks
    assert asyncio.all_tasks() - tasks_before <= {asyncio.current_task()}
    assert len(os.listdir("/proc/self/fd")) == fds_before
