"""Test-only fault hooks, `POST /debug/fault?...`:

- `task=NAME` makes a supervised task fail as if its loop had raised (see agent.supervisor);
- `block_loop=SECONDS` (0 < SECONDS <= 30) blocks the event loop for that long with `time.sleep`, as a blocking call
  or a spin in some part of the agent would. No real part can be made to do that on demand, so it is simulated
  here; tests use it to show that the loop watchdog (loop_watchdog.py) reports the stall and the agent goes
  on afterwards. The answer comes once the block is over.

Served only when the agent runs with `DEVICEPLANE_DEBUG_FAULTS=1` (off by default; the HTTP server listens on
127.0.0.1 only). Tests use them to show that a failure is seen (/readyz, the metrics, the log) and repaired.
"""

from __future__ import annotations

import math

from deviceplane.agent.serving.lean_http import TEXT, HttpError, Request, Respond, Route
from deviceplane.agent.supervisor import Supervisor
from deviceplane.debug_faults import block_event_loop

MAX_BLOCK_SECONDS = 30.0


def block_seconds(text: str) -> float:
    """`block_loop`'s value, or ValueError saying why not."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"block_loop={text!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_BLOCK_SECONDS:
        raise ValueError(f"block_loop={text!r}: expected seconds in (0, {MAX_BLOCK_SECONDS:g}]")
    return seconds


def fault_routes(supervisor: Supervisor) -> dict[tuple[str, str], Route]:
    def fault(request: Request, respond: Respond) -> None:
        query = request.params()
        if "block_loop" in query:
            if "task" in query:
                raise HttpError(400, "one fault per request: task or block_loop")
            try:
                seconds = block_seconds(query["block_loop"])
            except ValueError as err:
                raise HttpError(400, str(err)) from None
            block_event_loop(seconds)
            respond(200, f"event loop blocked for {seconds:g}s".encode(), TEXT)
            return
        name = query.get("task", "")
        if not supervisor.inject_fault(name):
            raise HttpError(404, f"no running supervised task {name!r}; tasks: {', '.join(supervisor.names)}")
        respond(200, f"fault injected into {name}".encode(), TEXT)

    return {("POST", "/debug/fault"): fault}
