"""Real processes for integration tests: the agent and the stdin-steered test plugin."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.01, what: str = "condition") -> T:
    """Poll `check` until it returns a truthy value; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None  # the last answer or error, for the failure's message
    while time.monotonic() < deadline:
        try:
            answer = check()
        except (OSError, urllib.error.URLError, ValueError) as err:
            last = err
        else:
            if answer:
                return answer
            last = answer
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def hold_down(proc: subprocess.Popen[Any], sig: int, interval: float, within: float = 30.0) -> int:
    """Send `sig` every `interval` seconds until `proc` exits (Ctrl-C held down, a supervisor repeating SIGTERM);
    how many were sent. Fails if it still runs after `within` seconds."""
    sent = 0
    deadline = time.monotonic() + within
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"still running after {sent} signals"
        proc.send_signal(sig)
        sent += 1
        time.sleep(interval)
    return sent


def wait_steady(read: Callable[[], T], hold: float = 0.5, timeout: float = 10.0, what: str = "value") -> T:
    """Poll `read` until it returns the same value for `hold` seconds, and return that value.

    For leak baselines: a count read while a transient task or fd is still alive would be one too high."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= hold:
            return value
    raise AssertionError(f"{what} did not hold steady for {hold}s within {timeout}s; last: {value!r}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class AgentProcess:
    def __init__(self, workdir: Path, *extra: str, plugin_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.plugin_dir = plugin_dir or workdir / "device-plugins"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.log_path = workdir / f"agent-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> AgentProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "deviceplane", "agent", "--standalone",
            "--plugin-dir", str(self.plugin_dir),
            "--pod-resources-socket", str(self.workdir / "pod-resources" / "kubelet.sock"),
            "--http-addr", f"127.0.0.1:{self.port}",
            "--node-name", "test-node",
            *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True)
        if wait:
            wait_for(lambda: self.get_text("/readyz") == "ok", timeout=20, what=f"agent ready ({self.log_path})")
        return self

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return str(response.read().decode())

    def get(self, path: str) -> Any:
        return json.loads(self.get_text(path))

    def resources(self) -> dict[str, dict[str, Any]]:
        return {r["name"]: r for r in self.get("/api/v1/devices")["resources"]}

    def resource(self, name: str) -> dict[str, Any] | None:
        return self.resources().get(name)

    def healthy(self) -> bool:
        return self.get_text("/healthz") == "ok"

    def devices(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """{id: (health, numa nodes)} of a connected resource, else None."""
        resource = self.resource(name)
        if resource is None or not resource["plugin"]["connected"]:
            return None
        return {d["id"]: (d["health"], tuple(d["numaNodes"])) for d in resource["devices"]}

    def counts(self, name: str) -> tuple[int, int] | None:
        r = self.resource(name)
        return None if r is None else (r["capacity"], r["allocatable"])

    def metric(self, name: str, **labels: str) -> float | None:
        for line in self.get_text("/metrics").splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                return float(value)
        return None

    def open_fds(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


class TestPlugin:
    """tests/support/testplugin.py as a process; `send` is one command/answer round trip."""

    __test__ = False  # not a pytest class

    def __init__(self, plugin_dir: Path, socket_name: str, devices: list[list[Any]] | None = None, *flags: str):
        cmd = [
            sys.executable, "-m", "tests.support.testplugin",
            "--plugin-dir", str(plugin_dir), "--socket", socket_name, "--devices", json.dumps(devices or []),
            *flags,
        ]  # fmt: skip
        self.socket_name = socket_name
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), cwd=ROOT, start_new_session=True
        )
        hello = self._read()
        assert hello.get("ok"), hello

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"test plugin exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def send(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        return self._read()

    def register(self, resource: str, **kw: Any) -> dict[str, Any]:
        return self.send(cmd="register", resource=resource, **kw)

    def devices(self, devices: list[list[Any]]) -> None:
        assert self.send(cmd="devices", devices=devices)["ok"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far, from /proc (clock ticks: 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """A process's resident set (VmRSS), MiB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
