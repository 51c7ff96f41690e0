"""`--debug-admit-api`: a local admit endpoint, off by default, a benchmarking aid (benchmarks/compare.py).

It lets a benchmark admit pods through the same kind of call as the kubelet harness's `/admit` (an HTTP request to
another process on 127.0.0.1), so the two are timed symmetrically. Pods admitted here form their own pod source
(`debug-api`, synced from the start): they go through exactly the admission path of static or API pods.

    POST /debug/v1/admit   a v1 Pod (JSON)  -> {"uid", "admitted", "state", "reason", "durationNs"}
    POST /debug/v1/remove  {"uid": "..."}  -> {"removed", "durationNs"}  (an admitted pod: answers once its release
                                                                        is on disk)

`durationNs` is measured inside the agent: from the pod handed to the admission runner until it settled (admit), or
until the release is durable (remove).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from deviceplane.agent.admission.runner import AdmissionRunner
from deviceplane.agent.serving.http_api import json_response
from deviceplane.core.pod_table import PodState
from deviceplane.core.pods import parse_pod

SOURCE = "debug-api"


class DebugAdmitApi:
    def __init__(self, runner: AdmissionRunner, durable: Callable[[], Awaitable[None]], node_name: str) -> None:
        self._runner = runner
        self._durable = durable
        self._node_name = node_name

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/debug/v1/admit", self._admit), web.post("/debug/v1/remove", self._remove)]

    async def _admit(self, request: web.Request) -> web.Response:
        try:
            pod = parse_pod(json.loads(await request.read()), self._node_name, SOURCE)
        except ValueError as err:  # bad JSON or PodError
            return json_response({"error": str(err)}, status=400)
        started = time.perf_counter_ns()
        self._runner.pod_set(SOURCE, pod.uid, pod)
        record = await self._runner.settled(pod.uid)
        elapsed = time.perf_counter_ns() - started
        state = str(record.state) if record is not None else "gone"  # removed while it was being admitted
        reason = record.reason if record is not None else ""
        return json_response(
            {"uid": pod.uid, "admitted": state == PodState.ADMITTED, "state": state, "reason": reason,
             "durationNs": elapsed}
        )  # fmt: skip

    async def _remove(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            uid = body["uid"]
            if not isinstance(uid, str) or not uid:
                raise ValueError("uid must be a non-empty string")
        except (ValueError, KeyError, TypeError) as err:
            return json_response({"error": f'POST {{"uid": "..."}}: {err}'}, status=400)
        started = time.perf_counter_ns()
        removed = self._runner.known(SOURCE, uid)
        self._runner.pod_gone(SOURCE, uid)
        await self._durable()
        return json_response({"removed": removed, "durationNs": time.perf_counter_ns() - started})
