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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from deviceplane.lean_grpc import Channel, RpcError
from tests.support.grpc_peer import pattern
from tests.support.procs import ROOT, child_env


class Peer:
    def __init__(self, socket: Path, *flags: str) -> None:
        self.socket = socket
        self.flags = flags
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.grpc_peer", str(self.socket), *self.flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=child_env(),
        )  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        return proc

    def restart(self) -> None:
        """A new server process on the same path (the old one killed if it still runs)."""
        self.kill()
        self.proc = self._start()

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
def peer(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Peer]:
    """The peer process; `@pytest.mark.parametrize("peer", [(flags...)], indirect=True)` passes it flags."""
    started = Peer(short_tmp / "peer.sock", *getattr(request, "param", ()))
    yield started
    started.kill()


@pytest.fixture
async def channel(peer: Peer) -> AsyncIterator[Channel]:
    opened = Channel(str(peer.socket))
    yield opened
    await opened.close()


def method(name: str) -> str:
    return f"/peer.Test/{name}"


async def stats(channel: Channel) -> dict[str, object]:
    return dict(json.loads(await channel.unary(method("Stats"), b"", 5)))


async def server_saw_cancellations(channel: Channel, count: int) -> None:
    """The server's handlers were cancelled (it got RST_STREAM), not left running: polled for up to 10 s (2 s was
    once too short on a machine loaded by other suites)."""
    for _ in range(500):
        if (await stats(channel))["cancelled"] == count:
            return
        await asyncio.sleep(0.02)
    assert (await stats(channel))["cancelled"] == count


async def test_unary_calls_carry_bytes_both_ways(channel: Channel) -> None:
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


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (grpc.StatusCode.UNKNOWN, "out of sim juice"),
        (grpc.StatusCode.INVALID_ARGUMENT, "ünïcödé ✓ 100% sure\nsecond line"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        (grpc.StatusCode.PERMISSION_DENIED, "%41 stays as typed"),
    ],
)
async def test_error_statuses_arrive_exactly(channel: Channel, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Fail"), json.dumps({"code": code.value[0], "message": message}).encode(), 5)
    assert (info.value.code(), info.value.details()) == (code, message)
    with pytest.raises(RpcError) as missing:
        await channel.unary("/peer.Test/NoSuchMethod", b"", 5)
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert await channel.unary(method("Echo"), b"still fine", 5) == b"still fine"


async def test_deadline_ends_the_call_and_the_server_hears_of_it(channel: Channel) -> None:
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


async def test_a_servers_own_deadline_exceeded_before_ours_passes_through(channel: Channel) -> None:
    """Only the call's own deadline is reported as "context deadline exceeded": a plugin's DEADLINE_EXCEEDED of its own
    (its own downstream timed out) keeps its words."""
    spec = {"code": grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "message": "gpu firmware did not answer"}
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Fail"), json.dumps(spec).encode(), 10)
    assert info.value.details() == "gpu firmware did not answer"


async def test_cancelled_caller_cancels_the_call(channel: Channel) -> None:
    call = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await server_saw_cancellations(channel, 1)


async def test_message_limit_is_grpcs_4_mib(channel: Channel) -> None:
    assert len(await channel.unary(method("Size"), str(4 << 20).encode(), 10)) == 4 << 20
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Size"), str((4 << 20) + 1).encode(), 10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "grpc: received message larger than max (4194305 vs. 4194304)"
    assert await channel.unary(method("Echo"), b"after", 5) == b"after"  # the connection is fine


async def test_stream_delivers_every_message_past_the_windows(channel: Channel) -> None:
    # 80 MiB: past the stream's 8 MiB window and the connection's 64 MiB, so both are topped up as it is read.
    received = [m async for m in channel.stream(method("Stream"), json.dumps({"count": 40, "size": 2 << 20}).encode())]
    assert len(received) == 40
    assert all(message == pattern(2 << 20, i) for i, message in enumerate(received))
    assert [m async for m in channel.stream(method("Stream"), b'{"count": 0, "size": 1}')] == []


async def test_stream_cancelled_from_this_side(channel: Channel) -> None:
    stream = channel.stream(method("Forever"), b"")
    assert await stream.__anext__() == b"first"
    stream.cancel()
    with pytest.raises(RpcError) as info:
        await stream.__anext__()
    assert info.value.code() == grpc.StatusCode.CANCELLED
    await server_saw_cancellations(channel, 1)


LIMIT_4 = pytest.mark.parametrize("peer", [("--max-concurrent-streams", "4")], indirect=True)


@LIMIT_4
async def test_calls_beyond_the_servers_stream_limit_wait_and_are_all_answered(channel: Channel) -> None:
    await channel.unary(method("Echo"), b"", 5)  # the server's SETTINGS (the limit) are in after this
    payloads = [str(i).encode() for i in range(200)]
    slow = [channel.unary(method("Slow"), b"0.05", 10) for _ in range(8)]
    results = await asyncio.gather(*slow, *(channel.unary(method("Echo"), p, 10) for p in payloads))
    assert results == [b"done"] * 8 + payloads


@pytest.mark.parametrize("peer", [("--max-concurrent-streams", "1")], indirect=True)
async def test_a_call_over_the_limit_is_not_sent_until_a_stream_ends(channel: Channel) -> None:
    """Held back, not sent and refused: with the one stream the server allows taken, the next call waits out its
    deadline without reaching the server (no REFUSED_STREAM to retry), and goes once the stream ends."""
    await channel.unary(method("Echo"), b"", 5)
    hung = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
    await asyncio.sleep(0.1)
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Echo"), b"waits", 0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert channel.retries == 0
    hung.cancel()
    with pytest.raises(asyncio.CancelledError):
        await hung
    assert await channel.unary(method("Echo"), b"goes", 5) == b"goes"
    assert channel.retries == 0


async def test_goaway_lets_calls_in_flight_finish_and_later_calls_redial(peer: Peer, channel: Channel) -> None:
    assert await channel.unary(method("Echo"), b"x", 5) == b"x"
    slow = asyncio.create_task(channel.unary(method("Slow"), b"0.5", 10))
    await asyncio.sleep(0.1)
    peer.graceful_stop()  # GOAWAY; the call in flight has a second to finish
    assert await slow == b"done"
    await asyncio.to_thread(peer.proc.wait, 10)
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Echo"), b"x", 5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"dial unix {peer.socket}: connect:" in info.value.details()
    peer.restart()  # the same path served again: the next call dials a new connection
    assert await channel.unary(method("Echo"), b"back", 5) == b"back"


@pytest.mark.parametrize("peer", [("--max-connection-age-ms", "300")], indirect=True)
async def test_a_draining_connection_keeps_its_calls_while_new_ones_use_a_new_one(channel: Channel) -> None:
    """A server that GOAWAYs old connections but keeps listening (max connection age, as grpc-go's and C-core's
    servers can): a call made during the drain dials a new connection, and the old one's call still finishes."""
    slow = asyncio.create_task(channel.unary(method("Slow"), b"1.0", 10))
    await asyncio.sleep(0.6)  # past the age: the server has sent GOAWAY on the first connection
    assert await channel.unary(method("Echo"), b"new", 5) == b"new"
    assert await slow == b"done"


async def test_killed_server_fails_calls_in_flight_and_the_channel_recovers(peer: Peer, channel: Channel) -> None:
    hung = asyncio.create_task(channel.unary(method("Hang"), b"", 30))
    await asyncio.sleep(0.2)
    peer.kill()
    with pytest.raises(RpcError) as info:
        await hung
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details().startswith("error reading from server")
    peer.restart()
    assert await channel.unary(method("Echo"), b"again", 5) == b"again"


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
    # As grpc-go's ClientConn.Close: the transport's close reaches a unary call in flight (UNAVAILABLE, with the
    # close's error), a stream and a later call are cancelled.
    with pytest.raises(RpcError) as info:
        await hung
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "rpc error: code = Canceled desc = grpc: the client connection is closing",
    )
    with pytest.raises(RpcError) as info:
        await stream.__anext__()
    assert info.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(RpcError) as info:
        await channel.unary(method("Echo"), b"", 5)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.CANCELLED,
        "grpc: the client connection is closing",
    )
    await asyncio.sleep(0.05)  # the transport's close callbacks
    assert asyncio.all_tasks() - tasks_before <= {asyncio.current_task()}
    assert len(os.listdir("/proc/self/fd")) == fds_before


# A call that starts in the loop pass in which a dial finished, before that dial's done-callbacks ran. The dial is
# wrapped to start it exactly then (a kubelet's Allocate arriving at that moment did so in tests/e2e/test_proxy.py);
# a client in a process of its own, since a frozen event loop cannot time itself out.
CALL_AS_THE_DIAL_ENDS = """
import asyncio, sys
from deviceplane.lean_grpc import Channel

async def main() -> None:
    channel = Channel(sys.argv[1])
    loop = asyncio.get_running_loop()
    second = []
    dial = channel._dial

    async def dial_then_call():
        connection = await dial()
        # Runs before the dial's callbacks; no deadline, as the kubelet's Allocate.
        second.append(loop.create_task(channel.unary("/peer.Test/Echo", b"second")))
        return connection

    channel._dial = dial_then_call
    assert await channel.unary("/peer.Test/Echo", b"first", 5) == b"first"
    assert await second[0] == b"second"
    await channel.close()

asyncio.run(main())
"""


def test_a_call_starting_as_a_dial_ends_uses_its_connection(peer: Peer) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", CALL_AS_THE_DIAL_ENDS, str(peer.socket)],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the client's event loop froze: the call kept awaiting the finished dial")
    assert done.returncode == 0, done.stderr
