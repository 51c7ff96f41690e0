"""HTTP/1.1 over a raw socket, for tests of serving/lean_http.py: send bytes as they are (damaged ones too), in
pieces, and split what comes back into responses, each checked to be complete and framed by Content-Length."""

from __future__ import annotations

import contextlib
import socket


def exchange(port: int, data: bytes, pieces: list[int]) -> bytes:
    """Send data in pieces, half-close, and read everything until the server closes. The server may close first
    (after an answer that ends the connection): what it sent before is still read."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as conn:
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for size in [*pieces, len(data)]:
                conn.sendall(data[sent : sent + size])
                sent += size
            conn.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := conn.recv(65536):
            received += chunk
        return bytes(received)


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Split a byte stream into HTTP responses: (status, header fields by lower-case name, body). A body is framed by
    Content-Length, except after an answer to HEAD, which has none: where the stream ends or the next response starts
    right after the head (no body of these servers starts with `HTTP/1.1 `), the body is empty."""
    found = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data[:200]
        lines = head.split(b"\r\n")
        version, status, _reason = lines[0].split(b" ", 2)
        assert version == b"HTTP/1.1"
        fields = {name.lower(): value for name, value in (line.split(b": ", 1) for line in lines[1:])}
        length = int(fields[b"content-length"])
        if not rest or rest.startswith(b"HTTP/1.1 "):
            length = 0  # an answer to HEAD
        assert len(rest) >= length
        found.append((int(status), fields, rest[:length]))
        data = rest[length:]
    return found
