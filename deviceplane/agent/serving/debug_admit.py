"""`--debug-admit-api 127.0.0.1:PORT`: a local admit endpoint, off by default, a benchmarking aid
(benchmarks/compare.py).

It lets a benchmark admit pods through the same kind of call as the kubelet harness's `/admit` (an HTTP request to
another process on 127.0.0.1), so the two are timed symmetrically. Pods admitted here form their own pod source
(`debug-api`, synced from the start): they go through exactly the admission path of static or API pods.

    POST /debug/v1/admit   a v1 Pod (JSON)  -> {"uid", "admitted", "state", "reason", "durationNs"}
    POST /debug/v1/remove  {"uid": "..."}  -> {"removed", "durationNs"}  (an admitted pod: answers once its release
                                                                        is on disk)

Bad input answers 400 `{"error"}`. `durationNs` is measured inside the agent: from the pod handed to the admission
runner until it settled (admit), or until the release is durable (remove).

Its routes are served on their own loopback port (so that they stay off the API's address) by the same small
HTTP/1.1 server as the API (serving/lean_http.py): aiohttp's per-request machinery cost ~1 ms of event-loop CPU per
admission, more than the kubelet harness's Go server, and would have charged the agent for the benchmark's entry
rather than for admission.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from deviceplane.agent.admission.runner import AdmissionRunner
from deviceplane.agent.serving.lean_http import Request, Respond, Route, error_body
from deviceplane.core.pod_table import PodRecord, PodState
from deviceplane.core.pods import parse_pod

SOURCE = "debug-api"
ADMIT_PATH = "/debug/v1/admit"
REMOVE_PATH = "/debug/v1/remove"


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


class DebugAdmitApi:
    def __init__(self, runner: AdmissionRunner, durable: Callable[[], asyncio.Future[None]], node_name: str) -> None:
        self._runner = runner
        self._durable = durable
        self._node_name = node_name

    def routes(self) -> dict[tuple[str, str], Route]:
        return {("POST", ADMIT_PATH): self._admit, ("POST", REMOVE_PATH): self._remove}

    def _admit(self, request: Request, respond: Respond) -> None:
        try:
            pod = parse_pod(json.loads(request.body), self._node_name, SOURCE)
        except (ValueError, RecursionError) as err:  # bad JSON (or nested too deep) or PodError
            respond(400, error_body(str(err) or type(err).__name__))
            return
        started = time.perf_counter_ns()
        self._runner.pod_set(SOURCE, pod.uid, pod)

        def settled(record: PodRecord | None) -> None:
            elapsed = time.perf_counter_ns() - started
            state = str(record.state) if record is not None else "gone"  # removed while it was being admitted
            reason = record.reason if record is not None else ""
            respond(200, _json({"uid": pod.uid, "admitted": state == PodState.ADMITTED, "state": state,
                                "reason": reason, "durationNs": elapsed}))  # fmt: skip

        self._runner.when_settled(pod.uid, settled)

    def _remove(self, request: Request, respond: Respond) -> None:
        try:
            uid = json.loads(request.body)["uid"]
            if not isinstance(uid, str) or not uid:
                raise ValueError("uid must be a non-empty string")
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            respond(400, error_body(f'POST {{"uid": "..."}}: {err}'))
            return
        started = time.perf_counter_ns()
        removed = self._runner.known(SOURCE, uid)
        self._runner.pod_gone(SOURCE, uid)

        def durable(done: asyncio.Future[None]) -> None:
            problem = "agent stopping" if done.cancelled() else done.exception()
            if problem is not None:
                respond(500, error_body(f"release not durable: {problem}"))
            else:
                respond(200, _json({"removed": removed, "durationNs": time.perf_counter_ns() - started}))

        self._durable().add_done_callback(durable)
