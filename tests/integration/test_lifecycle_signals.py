"""SIGTERM or SIGINT while the agent is still starting: it stops promptly, as it does once started: exit 0, the
plugin directory's lock released, kubelet.sock removed, nothing left half-built (found in review: a stop signal was
only looked at once start had finished, so an agent waiting at start ignored it for as long as it waited, forever
when the plugin watcher could not start)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplane.agent.state.journal import JOURNAL_DIRNAME
from tests.integration.test_agent_cluster_mode import unreachable_kubeconfig
from tests.support.procs import ROOT, AgentProcess, child_env, free_port, wait_for

# Far below the waits it cuts short: the API server check's 15 s, the watcher's restarts without end.
PROMPT_SECONDS = 5.0


def stop_and_time(proc: subprocess.Popen[bytes], sig: signal.Signals) -> tuple[int | None, float]:
    """Send `sig`; the exit code (None if the process outlived the wait) and how long it took."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code: int | None = proc.wait(PROMPT_SECONDS * 3)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - sent


def lock_is_free(plugin_dir: Path) -> bool:
    fd = os.open(plugin_dir / ".deviceplane-agent.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def assert_left_clean(plugin_dir: Path, log: str) -> None:
    assert lock_is_free(plugin_dir), "the plugin directory's lock is still held"
    assert not (plugin_dir / "kubelet.sock").exists(), "a dead kubelet.sock was left for plugins"
    assert "agent stopped" in log and "agent failed to start" not in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_start_waits_for_the_plugin_watcher(short_tmp: Path, sig: signal.Signals) -> None:
    """Start waits until the plugin watcher has looked at its directory; a watcher that cannot (its directory is a
    file here) is restarted by the supervisor, and start waited for it without end, deaf to SIGTERM."""
    not_a_directory = short_tmp / "registry"
    not_a_directory.write_text("")
    agent = AgentProcess(short_tmp, "--plugins-registry-dir", str(not_a_directory), plugin_dir=short_tmp / "dp")
    agent.start(wait=False)
    assert agent.proc is not None
    try:
        wait_for(lambda: "supervised task failed" in agent.log(), timeout=20, what="the watcher failing at start")
        wait_for((agent.plugin_dir / "kubelet.sock").exists, what="kubelet.sock bound")
        code, took = stop_and_time(agent.proc, sig)
        assert code == 0 and took < PROMPT_SECONDS, f"exit {code} after {took:.1f}s\n{agent.log()[-2000:]}"
        assert_left_clean(agent.plugin_dir, agent.log())
        # Start had opened the journal (restore comes before the wait): it was closed, its unused spare segment
        # removed, as at any clean stop (the journal of a start cut short was left open, a spare beside it).
        journal_dir = agent.plugin_dir / JOURNAL_DIRNAME
        segments = sorted(p.name for p in journal_dir.glob("deviceplane_allocations.*.journal"))
        assert len(segments) == 1, segments
    finally:
        agent.kill()


@pytest.fixture
def silent_apiserver() -> Iterator[socket.socket]:
    """A listening TCP socket that never answers: a hung API server."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(20)
        yield listener


def start_against(short_tmp: Path, apiserver: socket.socket) -> tuple[subprocess.Popen[bytes], Path]:
    """An agent in cluster mode with --require-apiserver, stopped inside its API server check (its request accepted,
    never answered); the process and its log."""
    kubeconfig, unreachable = unreachable_kubeconfig(short_tmp)
    server = f"https://127.0.0.1:{apiserver.getsockname()[1]}"
    kubeconfig.write_text(kubeconfig.read_text().replace(unreachable, server))
    log_path = short_tmp / "agent.log"
    cmd = [
        sys.executable, "-m", "deviceplane", "agent", "--node-name", "n1", "--plugin-dir", str(short_tmp / "dp"),
        "--pod-resources-socket", str(short_tmp / "pr.sock"), "--http-addr", f"127.0.0.1:{free_port()}",
        "--kubeconfig", str(kubeconfig), "--require-apiserver",
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), cwd=ROOT, start_new_session=True)
    return proc, log_path


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigterm_while_start_checks_the_api_server(short_tmp: Path, silent_apiserver: socket.socket) -> None:
    """`--require-apiserver` waits up to 15 s for the API server at start; SIGTERM cut it short only at the end,
    and then the agent reported a failed start (exit 1) although it was asked to stop."""
    proc, log_path = start_against(short_tmp, silent_apiserver)
    try:
        connection, _ = silent_apiserver.accept()  # the agent is inside its API server check
        code, took = stop_and_time(proc, signal.SIGTERM)
        text = log_path.read_text(errors="replace")
        assert code is not None and took < PROMPT_SECONDS, f"exit {code} after {took:.1f}s\n{text[-2000:]}"
        assert "stop signal during start" in text and "agent failed to start" not in text, text[-2000:]
        assert "Traceback" not in text, text[-3000:]
        connection.close()
    finally:
        kill(proc)


def test_sigterm_while_start_checks_the_api_server_exits_0(short_tmp: Path, silent_apiserver: socket.socket) -> None:
    """The API request's daemon thread (aio.off_loop) woke while the interpreter finalized, CPython 3.11 ended it with
    pthread_exit, and the process died of SIGABRT (exit -6) instead of exiting 0 (cli.exit_process)."""
    proc, log_path = start_against(short_tmp, silent_apiserver)
    try:
        connection, _ = silent_apiserver.accept()
        code, _took = stop_and_time(proc, signal.SIGTERM)
        assert code == 0, f"exit {code}\n{log_path.read_text(errors='replace')[-2000:]}"
        connection.close()
    finally:
        kill(proc)


def test_readyz_names_the_task_start_waits_for(short_tmp: Path) -> None:
    """While start waits for a plugin watcher that keeps failing, /readyz said only "starting": nothing told the
    operator which task held the agent back, nor why."""
    not_a_directory = short_tmp / "registry"
    not_a_directory.write_text("")
    agent = AgentProcess(short_tmp, "--plugins-registry-dir", str(not_a_directory), plugin_dir=short_tmp / "dp")
    agent.start(wait=False)
    try:
        wait_for(lambda: "supervised task failed" in agent.log(), timeout=20, what="the watcher failing at start")
        try:
            agent.get_text("/readyz")
        except urllib.error.HTTPError as err:
            answer = err.read().decode()
        else:
            raise AssertionError("ready although start has not finished")
        assert answer.startswith("starting: task plugin-watcher is down: FileExistsError"), answer
    finally:
        agent.kill()
