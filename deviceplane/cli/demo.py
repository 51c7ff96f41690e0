"""`deviceplane demo` (`make demo`): the agent and both reference plugins in a temp dir, and what the agent sees.

Everything runs as it would on a node - separate processes talking gRPC over unix sockets - only the directories
are temporary. The demo prints the agent's device table, marks a sim device unhealthy through the sim's control
endpoint, adds a file to the `files` plugin's directory, shows the agent noticing both, and shows which devices two
static pods got. Then it keeps printing changes until Ctrl-C or `--duration`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from deviceplane.core.constants import HEALTHY, UNHEALTHY
from deviceplane.plugin.sim import non_negative_float
from deviceplane.stop_signals import STOP_SIGNALS, ignore_stop_signals

T = TypeVar("T")

SIM = "example.com/sim"
COLA = "example.com/cola"
SIM_DEVICES = 8
CANS = ("can-0", "can-1", "can-2")  # the files plugin's first devices: one file each
FLIPPED = "sim-3"
PODS = {  # name -> (container, resource, count): static pods the agent admits
    "trainer": ("train", SIM, 2),
    "reader": ("read", COLA, 1),
}


class DemoError(Exception):
    """Something the demo needs did not come up; the message says what and where its log is."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=non_negative_float,
        default=None,
        help="after the walkthrough, keep watching this many seconds instead of until Ctrl-C",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, sockets)")


def run(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    workdir = Path(tempfile.mkdtemp(prefix="deviceplane-demo-", dir="/tmp"))  # short: socket paths are limited
    stop = StopRequest()
    # Ctrl-C and SIGTERM end the demo alike, through the cleanup below.
    previous = {sig: signal.signal(sig, stop.handle) for sig in STOP_SIGNALS}
    try:
        with _processes() as procs:
            Demo(console, workdir, procs, stop).run(args.duration)
        return 0
    except Stopped:
        console.print("\nstopped")
        return 0
    except DemoError as err:
        console.print(f"[red]demo failed:[/red] {err}")
        return 1
    finally:
        if args.keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        if stop.requested:  # the rest of a Ctrl-C burst must not interrupt the exit (exit 130 seen in CI)
            ignore_stop_signals()
        else:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Stopped(Exception):
    """Ctrl-C or SIGTERM, acted on."""


class StopRequest:
    """A signal only records the request; the demo acts on it where it checks (between its steps and sleeps).

    Raising from the handler instead (KeyboardInterrupt) lands anywhere: inside `Popen.poll()` between taking its
    waitpid lock and the `try` that releases it, the cleanup's `wait()` then blocks on that lock for ever."""

    def __init__(self) -> None:
        self.requested = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise Stopped


# -- processes -----------------------------------------------------------------------------------------------


class Processes:
    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            # Own session: a Ctrl-C in the terminal reaches only the demo, which then stops the children in order.
            proc = subprocess.Popen(
                [sys.executable, "-m", "deviceplane", *args], stdout=out, stderr=out, start_new_session=True
            )
        self.started.append((name, proc, log))
        return proc

    def check_alive(self) -> None:
        for name, proc, log in self.started:
            if proc.poll() is not None:
                raise DemoError(f"{name} exited with status {proc.returncode}; see {log}:\n{_tail(log)}")

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM to every child, plugins first; whoever is still running `grace` seconds later (all together, not
        each) is killed."""
        for _, proc, _ in reversed(self.started):  # plugins first, the agent last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, proc, _ in self.started:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def _processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return json.loads(text) if text.startswith(("{", "[")) else text


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5).close()


def _state(resources: list[dict[str, Any]]) -> Any:
    """What the watch loop compares: a change here prints the tables again."""
    return [(r["name"], r["plugin"]["connected"], r["devices"]) for r in resources]


# -- the walkthrough -----------------------------------------------------------------------------------------


class Demo:
    def __init__(self, console: Console, workdir: Path, procs: Processes, stop: StopRequest) -> None:
        self.console = console
        self.workdir = workdir
        self.procs = procs
        self.stop = stop
        self.plugin_dir = workdir / "device-plugins"
        self.cola_dir = workdir / "cola"
        self.pod_dir = workdir / "pods"
        self.agent_url = f"http://127.0.0.1:{_free_port()}"
        self.control_url = f"http://127.0.0.1:{_free_port()}"

    def wait(self, check: Callable[[], T | None], within: float, what: str) -> T:
        deadline = time.monotonic() + within
        while True:
            self.stop.check()
            self.procs.check_alive()
            try:
                value = check()
            except (OSError, ValueError, KeyError):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {within:g}s waiting for {what} (logs in {self.workdir})")
            time.sleep(0.05)

    def resource_list(self) -> list[dict[str, Any]]:
        """GET /api/v1/devices: the agent's resources, in its order."""
        return list(_get(f"{self.agent_url}/api/v1/devices")["resources"])

    def resources(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.resource_list()}

    def health(self, resource: str, device_id: str) -> str | None:
        for device in self.resources()[resource]["devices"]:
            if device["id"] == device_id:
                return str(device["health"])
        return None

    def run(self, duration: float | None) -> None:
        say = self.console.print
        self.plugin_dir.mkdir()
        self.cola_dir.mkdir()
        self.pod_dir.mkdir()
        for name in CANS:
            (self.cola_dir / name).write_text(f"{name}\n")

        say(f"[bold]deviceplane demo[/bold] in {self.workdir}")
        say(f"starting the agent (standalone, {self.agent_url}) ...")
        self.procs.start(
            "agent", self.workdir / "agent.log",
            "agent", "--standalone", "--node-name", "demo-node", "--numa-nodes", "2",
            "--plugin-dir", str(self.plugin_dir),
            "--pod-resources-socket", str(self.workdir / "pod-resources" / "kubelet.sock"),
            "--pod-manifest-dir", str(self.pod_dir),
            "--http-addr", self.agent_url.removeprefix("http://"),
        )  # fmt: skip
        self.wait(lambda: _get(f"{self.agent_url}/healthz"), 30, "the agent's /healthz")

        sim_shown = f"{SIM}, {SIM_DEVICES} devices on 2 NUMA nodes"
        say(f"starting plugins: sim ({sim_shown}) and files ({COLA}, {self.cola_dir}) ...")
        self.procs.start(
            "sim plugin", self.workdir / "sim.log",
            "plugin", "sim", "--plugin-dir", str(self.plugin_dir), "--resource", SIM,
            "--count", str(SIM_DEVICES), "--numa", "2",
            "--control", self.control_url.removeprefix("http://"),
        )  # fmt: skip
        self.procs.start(
            "files plugin", self.workdir / "files.log",
            "plugin", "files", "--plugin-dir", str(self.plugin_dir), "--resource", COLA, "--dir", str(self.cola_dir),
        )  # fmt: skip
        listed = {SIM: SIM_DEVICES, COLA: len(CANS)}
        self.wait(lambda: self._listed(listed), 30, "both plugins to register and list their devices")
        say(self.render("what the agent sees (GET /api/v1/devices)", self.resource_list()))

        say(f"\n[bold]marking {FLIPPED} unhealthy[/bold] (POST {self.control_url}/devices/{FLIPPED}/unhealthy)")
        started = time.monotonic()
        _post(f"{self.control_url}/devices/{FLIPPED}/unhealthy")
        self.wait(lambda: self.health(SIM, FLIPPED) == UNHEALTHY, 10, f"the agent to see {FLIPPED} unhealthy")
        elapsed_ms = (time.monotonic() - started) * 1000
        say(f"{FLIPPED}: {HEALTHY} -> {UNHEALTHY}, seen by the agent {elapsed_ms:.0f} ms after the request")
        (self.cola_dir / "can-3").write_text("can-3\n")
        say(f"created {self.cola_dir / 'can-3'}")
        self.wait(lambda: self.health(COLA, "can-3") == HEALTHY, 10, "the agent to see the new file")
        say(self.render("after the changes", self.resource_list()))

        self.admit_pods()

        limit = "Ctrl-C to stop" if duration is None else f"for {duration:g}s"
        say(f"\nwatching for changes ({limit}); try: curl -X POST {self.control_url}/devices/sim-0/unhealthy")
        self.watch(duration)

    def _listed(self, expected: dict[str, int]) -> bool:
        """Each plugin connected and its devices listed: registration alone comes before the first ListAndWatch
        answer, and the table would show the resource with no devices."""
        resources = self.resources()
        return all(
            name in resources and resources[name]["plugin"]["connected"] and len(resources[name]["devices"]) == count
            for name, count in expected.items()
        )

    def admit_pods(self) -> None:
        """Two static pods, and the devices the agent allocated to them."""
        for name, (container, resource, count) in PODS.items():
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "demo", "uid": f"demo-{name}"},
                "spec": {
                    "containers": [
                        {"name": container, "image": "busybox", "resources": {"limits": {resource: str(count)}}}
                    ]
                },
            }
            (self.pod_dir / f"{name}.json").write_text(json.dumps(pod))
        self.wait(self._pods_settled, 5, "static pods")
        self.console.print(f"\n[bold]static pods[/bold] written to {self.pod_dir}:")
        self.console.print(self.render_pods())
        self.console.print(self.render("devices with their pods", self.resource_list()))

    def _pods_settled(self) -> bool:
        pods = _get(f"{self.agent_url}/api/v1/pods")
        names = {p["name"] for p in pods if p.get("admitted") or p.get("reason")}
        return names >= set(PODS)

    def watch(self, duration: float | None) -> None:
        deadline = None if duration is None else time.monotonic() + duration
        last = _state(self.resource_list())
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
            self.stop.check()
            self.procs.check_alive()
            try:
                resources = self.resource_list()
            except (OSError, ValueError):
                continue
            state = _state(resources)
            if state != last:
                last = state
                self.console.print(self.render(time.strftime("changed at %H:%M:%S"), resources))

    # -- tables ----------------------------------------------------------------------------------------------

    def render(self, title: str, resources: list[dict[str, Any]]) -> Group:
        summary = Table(title_justify="left")
        for column in ("resource", "plugin", "capacity", "allocatable", "healthy", "allocated"):
            summary.add_column(column, justify="left" if column in ("resource", "plugin") else "right")
        devices = Table(title_justify="left")
        for column in ("resource", "device", "health", "NUMA", "allocated to"):
            devices.add_column(column)
        for resource in resources:
            connected = resource["plugin"]["connected"]
            summary.add_row(
                resource["name"],
                Text("connected", style="green") if connected else Text("disconnected", style="bold red"),
                *(str(resource[k]) for k in ("capacity", "allocatable", "healthy", "allocated")),
            )
            for device in resource["devices"]:
                owner = device.get("allocatedTo")
                devices.add_row(
                    resource["name"],
                    device["id"],
                    Text(device["health"], style="green" if device["health"] == HEALTHY else "bold red"),
                    ",".join(str(n) for n in device["numaNodes"]) or "-",
                    f"{owner['namespace']}/{owner['pod']}/{owner['container']}" if owner else "",
                )
            devices.add_section()
        return Group(Text(f"\n{title}", style="bold"), summary, devices)

    def render_pods(self) -> Table:
        table = Table(title_justify="left")
        for column in ("pod", "admitted", "container", "devices"):
            table.add_column(column)
        for pod in _get(f"{self.agent_url}/api/v1/pods"):
            for container in pod.get("containers") or [{"name": "", "devices": {}}]:
                devices = "; ".join(f"{r}: {','.join(ids)}" for r, ids in (container.get("devices") or {}).items())
                admitted = "yes" if pod.get("admitted") else f"no: {pod.get('reason', '')}"
                table.add_row(f"{pod['namespace']}/{pod['name']}", admitted, container["name"], devices)
        return table
