"""The agent's HTTP routes: /metrics, /healthz, /readyz, /api/v1/devices, /api/v1/pods (GET, and HEAD).

Served by serving/lean_http.py (the composition root makes the server): a count poll of /api/v1/devices costs the
event loop a fraction of what aiohttp's per-request machinery did, and the loop that answers it is the one that
applies device updates and admits pods."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pydantic_core
from prometheus_client import CONTENT_TYPE_LATEST

from deviceplane.agent.serving.lean_http import TEXT, Body, Request, Respond, Route

Check = Callable[[], str | None]
_METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.encode()


def json_body(payload: Any) -> bytes:
    """Compact JSON, non-ASCII as UTF-8. Written by pydantic's serializer (pydantic_core, already a dependency): a
    listing shaped like 5,000 pods' (2.8 MB) took 7 ms in process, against 25 ms through json.dumps."""
    try:
        return pydantic_core.to_json(payload)
    except pydantic_core.PydanticSerializationError:
        # A lone surrogate, which UTF-8 cannot carry: a static pod file whose name is not UTF-8 (os.scandir keeps its
        # bytes as surrogates). json.dumps writes it as a \u escape, as before.
        return json.dumps(payload, separators=(",", ":")).encode()


def api_routes(
    devices: Callable[[Mapping[str, str]], bytes],
    pods: Callable[[], Any],
    metrics: Callable[[], Body],
    health: Check,
    ready: Check,
) -> dict[tuple[str, str], Route]:
    """`devices` gets the query's parameters, returns the JSON body and raises lean_http.HttpError for a bad one;
    `metrics` returns the exposition text (in pieces); `health`/`ready` return None when fine, else the reason
    (served with 503)."""

    def get_devices(request: Request, respond: Respond) -> None:
        respond(200, devices(request.params()))

    def get_pods(_request: Request, respond: Respond) -> None:
        respond(200, json_body(pods()))

    def get_metrics(_request: Request, respond: Respond) -> None:
        respond(200, metrics(), _METRICS_CONTENT_TYPE)

    return {
        ("GET", "/api/v1/devices"): get_devices,
        ("GET", "/api/v1/pods"): get_pods,
        ("GET", "/metrics"): get_metrics,
        ("GET", "/healthz"): probe(health),
        ("GET", "/readyz"): probe(ready),
    }


def probe(check: Check) -> Route:
    def answer(_request: Request, respond: Respond) -> None:
        problem = check()
        if problem is None:
            respond(200, b"ok", TEXT)
        else:
            respond(503, problem.encode(), TEXT)

    return answer
