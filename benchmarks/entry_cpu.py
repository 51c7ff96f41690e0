"""CPU per admission through `--debug-admit-api`, and of the HTTP entry alone: numbers that hold up on a loaded
machine, where compare.py's wall-clock latencies swing by 30% or more.

1. The HTTP entry alone: a server process with one POST route that answers on the next loop step (as the debug
   admit route answers from the admission's done callback), served by aiohttp and by serving/lean_http.py; CPU of
   the server process per request, sequential and 8 concurrent keep-alive clients.
2. The agent: `deviceplane agent --debug-admit-api` with a 1,024-device sim plugin (Allocate only); CPU of the
   agent process (all its threads) per admit + remove of a 1-device pod, sequential and 8 concurrent, through the
   same client code as compare.py.

    python benchmarks/entry_cpu.py [--requests 5000] [--pods 600] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import PLAIN, AgentSide, Client, pod, start_sim, stop_procs, wait  # noqa: E402
from tests.support.procs import child_env, free_port  # noqa: E402

BODY = json.dumps(pod("x", PLAIN)).encode()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(kind: str, port: int) -> None:
    """The server process of part 1."""
    from aiohttp import web

    from deviceplane.agent.serving.lean_http import LeanHttpServer, Respond

    async def run() -> None:
        if kind == "aiohttp":

            async def handler(request: web.Request) -> web.Response:
                body = await request.read()
                return web.json_response({"length": len(body)})

            app = web.Application()
            app.router.add_post("/x", handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        else:
            loop = asyncio.get_running_loop()

            def route(body: bytes, respond: Respond) -> None:
                loop.call_soon(respond, 200, json.dumps({"length": len(body)}).encode())

            await LeanHttpServer({"/x": route}).start("127.0.0.1", port)
        await asyncio.Event().wait()

    asyncio.run(run())


def in_threads(work: list[Any], workers: int, one: Callable[[Any], Callable[[Any], None]]) -> None:
    """Spread `work` over `workers` threads; `one()` opens a thread's connection and returns its per-item call."""
    lock = threading.Lock()

    def worker() -> None:
        call = one(None)
        while True:
            with lock:
                if not work:
                    return
                item = work.pop()
            call(item)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def entry_alone(kind: str, requests: int) -> str:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], env=child_env(), cwd=ROOT)

    def connection(_: Any) -> Callable[[Any], None]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def post(body: bytes) -> None:
            conn.request("POST", "/x", body, {"Content-Type": "application/json"})
            conn.getresponse().read()

        return post

    try:
        wait(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 30, f"{kind} server")
        in_threads([BODY] * 200, 1, connection)  # warm-up
        figures = []
        for workers in (1, 8):
            before = cpu_seconds(proc.pid)
            in_threads([BODY] * requests, workers, connection)
            figures.append((cpu_seconds(proc.pid) - before) / requests * 1e6)
        return f"{kind:<8} server CPU per request: sequential {figures[0]:5.0f} us, 8 concurrent {figures[1]:5.0f} us"
    finally:
        stop_procs([proc])


def agent_cpu(pods: int, run: int) -> str:
    side = AgentSide(Path(tempfile.mkdtemp(prefix="dp-entry-", dir="/tmp")))
    sims = []

    def connection(_: Any) -> Callable[[Any], None]:
        client = Client(side.admit_port)

        def admit_and_remove(uid: str) -> None:
            _, answer = client.post(side.admit_path, pod(uid, PLAIN))
            if not answer.get("admitted"):
                raise RuntimeError(f"{uid} not admitted: {answer}")
            client.post(side.remove_path, {"uid": uid})

        return admit_and_remove

    try:
        side.start()
        assert side.proc is not None
        sims.append(start_sim(side, PLAIN, 1024, 2, "--no-preferred-allocation", "--no-pre-start"))
        wait(lambda: side.counts(PLAIN) == (1024, 1024), 60, "the sim's devices")
        figures = []
        for workers in (1, 8):
            before = cpu_seconds(side.proc.pid)
            in_threads([f"r{run}-w{workers}-{i}" for i in range(pods)], workers, connection)
            figures.append((cpu_seconds(side.proc.pid) - before) / pods * 1e3)
        return f"agent CPU per admit + remove: sequential {figures[0]:.2f} ms, 8 concurrent {figures[1]:.2f} ms"
    finally:
        stop_procs(sims)
        side.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per entry cell [5000]")
    parser.add_argument("--pods", type=int, default=600, help="pods per agent cell [600]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (aiohttp, lean, the agent) [3]")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", flush=True)
    for run in range(args.rounds):
        for kind in ("aiohttp", "lean"):
            print(entry_alone(kind, args.requests), flush=True)
        print(agent_cpu(args.pods, run), flush=True)


if __name__ == "__main__":
    main()
