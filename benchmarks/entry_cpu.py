"""CPU per admission through `--debug-admit-api`, and of the HTTP entry alone: numbers that hold up on a loaded
machine, where compare.py's wall-clock latencies swing by 30% or more.

1. The HTTP entry alone: a server process with one POST route that answers on the next loop step (as the debug
   admit route answers from the admission's done callback) and one GET route that answers at once (as the API's
   count poll does), served by aiohttp and by serving/lean_http.py; CPU of the server process per request, POSTs
   sequential and from 8 concurrent keep-alive clients, GETs sequential.
2. The agent: `deviceplane agent --debug-admit-api` with a 1,024-device sim plugin (Allocate only, or with
   --all-rpcs GetPreferredAllocation and PreStartContainer too), 1-device pods admitted through compare.py's load
   generator (admit-load), sequential and 8 concurrent: admissions/s, CPU per admission of the agent (all its
   threads, and its event-loop thread alone), the sim plugin and the load generator, and context switches per
   admission of the agent and the sim (each a thread going to sleep or preempted). Where a throughput limit comes
   from on 2 CPUs: these add up to what one admission costs the machine.

    python benchmarks/entry_cpu.py [--requests 5000] [--pods 600] [--rounds 3] [--all-rpcs] [--only agent]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import resource
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

from benchmarks.compare import PLAIN, AgentSide, admit_many, pod, remove_many, start_sim, stop_procs, wait  # noqa: E402
from tests.support.procs import child_env, free_port  # noqa: E402

BODY = json.dumps(pod("x", PLAIN)).encode()


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """utime + stime of a process (all threads), or of one of its threads."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of all of a process's threads (each a sleep or preemption)."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in Path(f"/proc/{pid}/task/{thread}/status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def serve(kind: str, port: int) -> None:
    """The server process of part 1."""
    from aiohttp import web

    from deviceplane.agent.serving.lean_http import LeanHttpServer, Request, Respond

    async def run() -> None:
        if kind == "aiohttp":

            async def handler(request: web.Request) -> web.Response:
                body = await request.read()
                return web.json_response({"length": len(body)})

            async def get(request: web.Request) -> web.Response:
                return web.json_response({"query": request.query.get("q")})

            app = web.Application()
            app.router.add_post("/x", handler)
            app.router.add_get("/y", get)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        else:
            loop = asyncio.get_running_loop()

            def route(request: Request, respond: Respond) -> None:
                loop.call_soon(respond, 200, json.dumps({"length": len(request.body)}).encode())

            def lean_get(request: Request, respond: Respond) -> None:
                respond(200, json.dumps({"query": request.params().get("q")}).encode())

            await LeanHttpServer({("POST", "/x"): route, ("GET", "/y"): lean_get}).start(f"127.0.0.1:{port}")
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
            if body:
                conn.request("POST", "/x", body, {"Content-Type": "application/json"})
            else:
                conn.request("GET", "/y?q=example.com%2Fr&limit=0")
            conn.getresponse().read()

        return post

    try:
        wait(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 30, f"{kind} server")
        in_threads([BODY] * 200, 1, connection)  # warm-up
        figures = []
        for body, workers in ((BODY, 1), (BODY, 8), (b"", 1)):  # b"": a GET
            before = cpu_seconds(proc.pid)
            in_threads([body] * requests, workers, connection)
            figures.append((cpu_seconds(proc.pid) - before) / requests * 1e6)
        return (
            f"{kind:<8} server CPU per request: POST sequential {figures[0]:5.0f} us, 8 concurrent {figures[1]:5.0f} us"
            f"; GET sequential {figures[2]:5.0f} us"
        )
    finally:
        stop_procs([proc])


def agent_cpu(pods: int, run: int, all_rpcs: bool) -> str:
    side = AgentSide(Path(tempfile.mkdtemp(prefix="dp-entry-", dir="/tmp")))
    sims = []
    try:
        side.start()
        assert side.proc is not None
        pid = side.proc.pid  # the event loop runs in the main thread, whose id is the pid
        flags = () if all_rpcs else ("--no-preferred-allocation", "--no-pre-start")
        sims.append(start_sim(side, PLAIN, 1024, 2, *flags))
        wait(lambda: side.counts(PLAIN) == (1024, 1024), 60, "the sim's devices")
        admit_many(side, f"warm{run}", PLAIN, 200, 8)
        remove_many(side, f"warm{run}", 200)
        figures = []
        for workers in (1, 8):
            prefix = f"r{run}-w{workers}"
            switches = (context_switches(pid), context_switches(sims[0].pid))
            before = (cpu_seconds(pid), cpu_seconds(pid, pid), cpu_seconds(sims[0].pid), children_cpu())
            cell = admit_many(side, prefix, PLAIN, pods, workers)
            after = (cpu_seconds(pid), cpu_seconds(pid, pid), cpu_seconds(sims[0].pid), children_cpu())
            agent_switches = (context_switches(pid) - switches[0]) / pods
            sim_switches = (context_switches(sims[0].pid) - switches[1]) / pods
            remove_many(side, prefix, pods)
            agent, loop, sim, client = ((a - b) / pods * 1e6 for a, b in zip(after, before, strict=True))
            how = "sequential" if workers == 1 else f"{workers} concurrent"
            figures.append(
                f"{how}: {pods / cell.wall:,.0f}/s, CPU per admission: agent {agent:.0f} us (event loop {loop:.0f}), "
                f"sim {sim:.0f}, load generator {client:.0f}; context switches per admission: agent "
                f"{agent_switches:.1f}, sim {sim_switches:.1f}"
            )
        what = "Allocate + GetPreferredAllocation + PreStart" if all_rpcs else "Allocate only"
        return f"agent ({what}) " + "; ".join(figures)
    finally:
        stop_procs(sims)
        side.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per entry cell [5000]")
    parser.add_argument("--pods", type=int, default=600, help="pods per agent cell [600]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (aiohttp, lean, the agent) [3]")
    parser.add_argument(
        "--all-rpcs", action="store_true", help="the sim also asks for GetPreferredAllocation, PreStart"
    )
    parser.add_argument("--only", choices=("entry", "agent"), help="run one part")
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", flush=True)
    for run in range(args.rounds):
        if args.only != "agent":
            for kind in ("aiohttp", "lean"):
                print(entry_alone(kind, args.requests), flush=True)
        if args.only != "entry":
            print(agent_cpu(args.pods, run, args.all_rpcs), flush=True)


if __name__ == "__main__":
    main()
