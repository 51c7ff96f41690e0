"""A test-only fault hook: `POST /debug/fault?task=NAME` makes a supervised task fail as if its loop had raised.

Served only when the agent runs with `DEVICEPLANE_DEBUG_FAULTS=1` (off by default; the HTTP server listens on
127.0.0.1 only). Tests use it to show that any supervised task's failure is seen (/readyz, the restart counter, the
log) and repaired (restarted after its backoff); see agent.supervisor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from aiohttp import web

from deviceplane.agent.supervisor import Supervisor

DEBUG_FAULTS_ENV = "DEVICEPLANE_DEBUG_FAULTS"


def debug_faults_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(DEBUG_FAULTS_ENV) == "1"


def add_fault_route(app: web.Application, supervisor: Supervisor) -> None:
    async def fault(request: web.Request) -> web.Response:
        name = request.query.get("task", "")
        if not supervisor.inject_fault(name):
            raise web.HTTPNotFound(text=f"no running supervised task {name!r}; tasks: {', '.join(supervisor.names)}")
        return web.Response(text=f"fault injected into {name}")

    app.router.add_post("/debug/fault", fault)
