"""`deviceplane status --url`: its help says it takes the agent's HTTP address (`--http-addr`), which is HOST:PORT."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deviceplane.cli import main

DEVICES = {"resources": [], "agent": {"version": "0.1.0", "node": "n1", "lastHeartbeatTime": "x"}, "conditions": []}


class _Agent(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/api/v1/devices": DEVICES, "/api/v1/pods": []}.get(self.path.partition("?")[0])
        if body is None:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def http_addr() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Agent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_status_takes_the_agents_http_addr_as_is(http_addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", http_addr, "-o", "json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out) == {"devices": DEVICES, "pods": []}


def test_status_takes_a_url_too(http_addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", f"http://{http_addr}/", "-o", "json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["devices"] == DEVICES
