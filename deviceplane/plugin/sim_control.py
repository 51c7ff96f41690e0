"""The sim plugin's HTTP control endpoint (JSON), for tests, demos and people with curl.

  GET    /healthz                        "ok"
  GET    /devices                        {"resource", "socket", "registrations", "flapRate", "flips",
                                          "devices": [{"id", "health", "numaNodes"}]}
  POST   /devices/{id}/healthy           mark one device Healthy      (404 for an unknown id)
  POST   /devices/{id}/unhealthy         mark one device Unhealthy
  POST   /health   {"sim-0": false, ...} several changes in one ListAndWatch snapshot
  GET    /calls                          {"counts": {rpc: n}, "Allocate": [...], "GetPreferredAllocation": [...],
                                          "PreStartContainer": [...]} - one entry per container request, in order;
                                          counts are exact, entries the latest 1,000 per RPC
  DELETE /calls                          forget recorded calls
  GET    /faults                         injected faults by RPC
  PUT    /faults/{rpc}  {"mode": "fail"|"hang", "message"?, "seconds"?, "times"?}
                                         seconds 0 to 86,400, times 1 to 1,000,000 (sim_bounds); else 400
                                         with the reason
  DELETE /faults/{rpc}
  PUT    /flap  {"rate": flips_per_second}   0 to 1000

The bound address is printed on stdout as `control: http://HOST:PORT` (useful with port 0).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from deviceplane.core.constants import HEALTHY, UNHEALTHY
from deviceplane.plugin.plugin import PluginError
from deviceplane.plugin.sim import RPCS, Fault, SimPlugin
from deviceplane.plugin.sim_bounds import FLAP_RATE

SIM_KEY = web.AppKey("sim", SimPlugin)


def _sim(request: web.Request) -> SimPlugin:
    return request.app[SIM_KEY]


def _http_error(error: type[web.HTTPError], message: str) -> web.HTTPError:
    """An error response with a JSON body, to raise."""
    return error(text=json.dumps({"error": message}), content_type="application/json")


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _http_error(web.HTTPBadRequest, "body must be JSON") from None


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def get_devices(request: web.Request) -> web.Response:
    sim = _sim(request)
    return web.json_response(
        {
            "resource": sim.plugin.resource,
            "socket": str(sim.plugin.socket_path),
            "registrations": sim.plugin.registrations,
            "flapRate": sim.flap_rate,
            "flips": sim.flips,
            "devices": [
                {"id": d.id, "health": HEALTHY if d.healthy else UNHEALTHY, "numaNodes": list(d.numa_nodes)}
                for d in sim.plugin.devices
            ],
        }
    )


def _set_health(request: web.Request, changes: dict[str, bool]) -> web.Response:
    try:
        _sim(request).set_health(changes)
    except KeyError as err:
        raise _http_error(web.HTTPNotFound, str(err.args[0])) from None
    return web.json_response({"ok": True})


async def mark_healthy(request: web.Request) -> web.Response:
    return _set_health(request, {request.match_info["id"]: True})


async def mark_unhealthy(request: web.Request) -> web.Response:
    return _set_health(request, {request.match_info["id"]: False})


async def set_health(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if not isinstance(body, dict) or not all(isinstance(v, bool) for v in body.values()):
        raise _http_error(web.HTTPBadRequest, 'expected {"<device id>": true|false, ...}')
    return _set_health(request, body)


async def get_calls(request: web.Request) -> web.Response:
    calls = _sim(request).calls
    return web.json_response({"counts": calls.counts(), **calls.entries()})


async def reset_calls(request: web.Request) -> web.Response:
    _sim(request).calls.clear()
    return web.json_response({"ok": True})


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response({rpc: fault.to_json() for rpc, fault in _sim(request).faults.items()})


def _rpc(request: web.Request) -> str:
    rpc = request.match_info["rpc"]
    if rpc not in RPCS:
        raise _http_error(web.HTTPNotFound, f"unknown RPC {rpc!r}; one of {', '.join(RPCS)}")
    return rpc


async def put_fault(request: web.Request) -> web.Response:
    rpc = _rpc(request)
    try:
        fault = Fault.from_json(await _json_body(request))
    except ValueError as err:
        raise _http_error(web.HTTPBadRequest, str(err)) from None
    _sim(request).faults[rpc] = fault
    return web.json_response({"ok": True})


async def delete_fault(request: web.Request) -> web.Response:
    _sim(request).faults.pop(_rpc(request), None)
    return web.json_response({"ok": True})


async def put_flap(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if not isinstance(body, dict) or "rate" not in body:
        raise _http_error(web.HTTPBadRequest, f'expected {{"rate": <{FLAP_RATE.described()}>}}')
    try:
        _sim(request).flap_rate = FLAP_RATE.check(body["rate"])
    except ValueError as err:
        raise _http_error(web.HTTPBadRequest, str(err)) from None
    return web.json_response({"ok": True})


def build_app(sim: SimPlugin) -> web.Application:
    app = web.Application()
    app[SIM_KEY] = sim
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/devices", get_devices)
    app.router.add_post("/devices/{id}/healthy", mark_healthy)
    app.router.add_post("/devices/{id}/unhealthy", mark_unhealthy)
    app.router.add_post("/health", set_health)
    app.router.add_get("/calls", get_calls)
    app.router.add_delete("/calls", reset_calls)
    app.router.add_get("/faults", get_faults)
    app.router.add_put("/faults/{rpc}", put_fault)
    app.router.add_delete("/faults/{rpc}", delete_fault)
    app.router.add_put("/flap", put_flap)
    return app


async def start_control(sim: SimPlugin, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(build_app(sim), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:
        await runner.cleanup()
        raise PluginError(f"cannot serve the control endpoint on {host}:{port}: {err.strerror}") from None
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"control: http://{bound_host}:{bound_port}", flush=True)
    return runner
