"""A TCP proxy between a client and a server, for faults of the network between them: real connections, which the
test can cut (both ends see the connection closed mid-stream, as when a server restarts) or blackhole (nothing more
is forwarded either way and nothing is closed: a connection that died silently, as behind a lost NAT entry), at once
or once an answer is partly through. Connections opened after a fault are forwarded as usual, unless the blackhole
takes new ones too (a server that takes connections and never answers) until `restore`."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Link:
    client: socket.socket
    server: socket.socket
    forwarding: bool = True
    to_client_budget: int | None = None  # bytes still passed on to the client before the link goes silent
    threads: list[threading.Thread] = field(default_factory=list)

    def pass_on(self, data: bytes, dst: socket.socket) -> None:
        if not self.forwarding:
            return  # read and dropped
        if dst is self.client and self.to_client_budget is not None:
            data = data[: self.to_client_budget]
            self.to_client_budget -= len(data)
            self.forwarding = self.to_client_budget > 0
        if data:
            dst.sendall(data)

    def close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pumps blocked in recv, sends the FIN
            sock.close()


class TcpProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.accepted = 0  # connections accepted so far
        self._blackhole_new = False  # new connections forward nothing either
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # so the accept loop sees close()
        self.port = int(self._listener.getsockname()[1])
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> int:
        """Close every open connection, both ends; the number closed."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        return len(links)

    def blackhole(self, new_connections: bool = False) -> int:
        """Stop forwarding on every open connection, without closing any; the number affected. What arrives on
        them is read and dropped, so neither end's writes block. With `new_connections`, so on every connection
        accepted from now on too (each still counted in `accepted`)."""
        with self._lock:
            self._blackhole_new = self._blackhole_new or new_connections
            links = list(self._links)
        for link in links:
            link.forwarding = False
        return len(links)

    def blackhole_newest_after(self, to_client: int) -> None:
        """The connection accepted last passes `to_client` more bytes on to the client (blackholed before or not),
        then is blackholed: a connection lost while an answer arrives, its headers and the start of its body when
        `to_client` is past the headers. A Kubernetes client's pool hands out the connection released last first
        (urllib3's pool is a stack): after `idle_pooled_connections`, this one."""
        with self._lock:
            link = self._links[-1]
        link.to_client_budget = to_client
        link.forwarding = to_client > 0

    def restore(self) -> None:
        """Forward on connections accepted from now on again (ends `blackhole(new_connections=True)`). The blackholed
        ones stay silent, open on both ends: connections that died in an outage (a lost NAT or load-balancer entry, an
        API server host replaced) do not come back with the server, so the client has to notice them."""
        with self._lock:
            self._blackhole_new = False

    def close(self) -> None:
        self._closed.set()
        self._acceptor.join(timeout=5)
        self._listener.close()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        for link in links:
            for thread in link.threads:
                thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                link = _Link(client, server, forwarding=not self._blackhole_new)
                self.accepted += 1
                self._links.append(link)
            for src, dst in ((client, server), (server, client)):
                thread = threading.Thread(target=self._pump, args=(link, src, dst), name="tcp-proxy", daemon=True)
                link.threads.append(thread)
                thread.start()

    @staticmethod
    def _pump(link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                link.pass_on(data, dst)
            if link.forwarding:
                dst.shutdown(socket.SHUT_WR)  # pass the end on: a half-close stays a half-close
        except OSError:
            pass


def idle_pooled_connections(proxy: TcpProxy, request: Callable[[], Any], count: int) -> None:
    """`count` connections left idle in a Kubernetes client's pool, each the proxy's (`request`: one of the client's
    calls made with `_preload_content=False`, made `count` times at once), in the order the proxy accepted them: the
    last one is on top of the pool, taken first."""
    held = [request() for _ in range(count)]
    for response in held:
        response.read()  # to its end: a connection with an unread answer is not reused
        response.release_conn()  # idle in the pool
    assert proxy.accepted == count


def silenced_pooled_connections(proxy: TcpProxy, request: Callable[[], Any], count: int) -> None:
    """`count` connections left idle in a Kubernetes client's pool (`idle_pooled_connections`), then silenced, as
    after a lost NAT entry: the proxy forwards new connections again, the pooled ones stay silent."""
    idle_pooled_connections(proxy, request, count)
    assert proxy.blackhole() == count
