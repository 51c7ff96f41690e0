"""The agent's HTTP endpoints: /metrics, /healthz, /readyz, /api/v1/devices, /api/v1/pods."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

JsonSource = Callable[[web.Request], Any]


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(payload, separators=(",", ":")), status=status, content_type="application/json")


def build_app(
    devices: JsonSource,
    pods: JsonSource,
    metrics: CollectorRegistry,
    health: Callable[[], str | None],
    ready: Callable[[], str | None],
) -> web.Application:
    """`health`/`ready` return None when fine, else the reason (served with 503)."""

    async def get_devices(request: web.Request) -> web.Response:
        return json_response(devices(request))

    async def get_pods(request: web.Request) -> web.Response:
        return json_response(pods(request))

    async def get_metrics(_request: web.Request) -> web.Response:
        body = generate_latest(metrics)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def probe(check: Callable[[], str | None]) -> Callable[[web.Request], Any]:
        async def handler(_request: web.Request) -> web.Response:
            problem = check()
            if problem is None:
                return web.Response(text="ok")
            return web.Response(status=503, text=problem)

        return handler

    app = web.Application()
    app.router.add_get("/api/v1/devices", get_devices)
    app.router.add_get("/api/v1/pods", get_pods)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", probe(health))
    app.router.add_get("/readyz", probe(ready))
    return app


async def serve(app: web.Application, address: str) -> web.AppRunner:
    host, _, port = address.rpartition(":")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port))  # "[::1]:9450" is accepted by --http-addr
    await site.start()
    return runner
