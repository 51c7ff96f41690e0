"""The agent's HTTP endpoints: /metrics, /healthz, /readyz, /api/v1/devices, /api/v1/pods (GET, and HEAD).

Served by serving/lean_http.py: a count poll of /api/v1/devices costs the event loop a fraction of what aiohttp's
per-request machinery did, and the loop that answers it is the one that applies device updates and admits pods."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from deviceplane.agent.serving.lean_http import TEXT, LeanHttpServer, Request, Respond, Route

Check = Callable[[], str | None]


def json_body(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


class HttpApi:
    """`health`/`ready` return None when fine, else the reason (served with 503). `devices` gets the query's
    parameters and raises lean_http.HttpError for a bad one. `extra` adds routes (the debug fault hooks)."""

    def __init__(
        self,
        devices: Callable[[Mapping[str, str]], Any],
        pods: Callable[[], Any],
        metrics: CollectorRegistry,
        health: Check,
        ready: Check,
        extra: Mapping[tuple[str, str], Route] | None = None,
    ) -> None:
        self._devices = devices
        self._pods = pods
        self._metrics = metrics
        self._content_type = CONTENT_TYPE_LATEST.encode()
        routes: dict[tuple[str, str], Route] = {
            ("GET", "/api/v1/devices"): self._get_devices,
            ("GET", "/api/v1/pods"): self._get_pods,
            ("GET", "/metrics"): self._get_metrics,
            ("GET", "/healthz"): probe(health),
            ("GET", "/readyz"): probe(ready),
        }
        routes.update(extra or {})
        self._server = LeanHttpServer(routes)

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        # "[::1]:9450" is accepted by --http-addr
        await self._server.start(host.strip("[]") or "127.0.0.1", int(port))

    @property
    def port(self) -> int:
        return self._server.port

    async def close(self) -> None:
        await self._server.close()

    def _get_devices(self, request: Request, respond: Respond) -> None:
        respond(200, json_body(self._devices(request.params())))

    def _get_pods(self, _request: Request, respond: Respond) -> None:
        respond(200, json_body(self._pods()))

    def _get_metrics(self, _request: Request, respond: Respond) -> None:
        respond(200, generate_latest(self._metrics), self._content_type)


def probe(check: Check) -> Route:
    def answer(_request: Request, respond: Respond) -> None:
        problem = check()
        if problem is None:
            respond(200, b"ok", TEXT)
        else:
            respond(503, problem.encode(), TEXT)

    return answer
