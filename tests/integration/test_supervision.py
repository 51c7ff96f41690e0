"""Supervision through the real agent process: making any supervised task fail (through the debug fault hook,
`DEVICEPLANE_DEBUG_FAULTS=1`; the task is cancelled with a marker at its current await and the supervisor treats
it exactly as a raise) is visible in /readyz, in `deviceplane_agent_task_restarts_total{task}` and in the log
within 1 s, and the task is back within its backoff and does its job again."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplane.agent.supervisor import INITIAL_BACKOFF_SECONDS
from tests.support.pods import pods, simple_pod, wait_settled
from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/sup"
EXPECTED_TASKS = {
    "grace-period-expiry", "registration-socket", "checkpoint-pacer", "pod-resources-socket", "pod-source:file",
    "heap-settle", "plugin-watcher",
}  # fmt: skip


def task_restarts(agent: AgentProcess) -> dict[str, float]:
    out = {}
    for line in agent.get_text("/metrics").splitlines():
        if line.startswith("deviceplane_agent_task_restarts_total{"):
            series, _, value = line.rpartition(" ")
            out[series.split('task="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def readyz(agent: AgentProcess) -> tuple[int, str]:
    try:
        return 200, agent.get_text("/readyz")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def inject(agent: AgentProcess, task: str) -> int:
    request = urllib.request.Request(f"{agent.url}/debug/fault?task={task}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return err.code


def failure_logged(agent: AgentProcess, task: str, count: int) -> bool:
    entries = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
    failed = [e for e in entries if e.get("msg") == "supervised task failed; restarting it" and e.get("task") == task]
    return len(failed) >= count and "Traceback" in failed[-1].get("exception", "")


@pytest.fixture
def debug_agent(
    agent_factory: Callable[..., AgentProcess], short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> AgentProcess:
    monkeypatch.setenv("DEVICEPLANE_DEBUG_FAULTS", "1")
    return agent_factory(
        "--pod-manifest-dir", str(short_tmp / "pods"), "--plugins-registry-dir", str(short_tmp / "registry"),
        "--startup-plugin-wait", "0s",
    )  # fmt: skip


def test_every_supervised_task_failure_is_seen_and_repaired(
    debug_agent: AgentProcess, plugin_factory: Callable[..., TestPlugin], short_tmp: Path
) -> None:
    agent = debug_agent
    plugin = plugin_factory(agent.plugin_dir, "sup.sock", [["d0", "Healthy"], ["d1", "Healthy"]])
    assert plugin.register(R)["ok"]
    wait_for(lambda: agent.counts(R) == (2, 2))
    tasks = task_restarts(agent)
    assert set(tasks) == EXPECTED_TASKS and set(tasks.values()) == {0.0}, tasks

    for task in sorted(tasks):
        injected = time.monotonic()
        assert inject(agent, task) == 200
        wait_for(lambda t=task: (s := readyz(agent))[0] == 503 and f"task {t} is down: InjectedFault" in s[1],
                 timeout=1.0, interval=0.005, what=f"/readyz naming {task}")  # fmt: skip
        wait_for(lambda t=task: task_restarts(agent)[t] == 1.0, timeout=1.0 - (time.monotonic() - injected),
                 interval=0.005, what=f"restart counted for {task}")  # fmt: skip
        wait_for(lambda t=task: failure_logged(agent, t, 1), timeout=max(0.05, 1.0 - (time.monotonic() - injected)),
                 interval=0.005, what=f"traceback logged for {task}")  # fmt: skip
        assert time.monotonic() - injected <= 1.0
        # back within its backoff (1 s), with a second of slack for a loaded machine
        wait_for(lambda: readyz(agent) == (200, "ok"), timeout=INITIAL_BACKOFF_SECONDS + 1.0, interval=0.01,
                 what=f"{task} back")  # fmt: skip
        assert agent.proc is not None and agent.proc.poll() is None

    # each restarted task does its job again
    simple_pod(short_tmp / "pods", "after", R, 1)  # pod source: new files are read
    assert wait_settled(agent, "after")["admitted"]
    (short_tmp / "pods" / "after.json").unlink()  # ... and removed ones freed
    wait_for(lambda: "after" not in pods(agent) and agent.resource(R)["allocated"] == 0, what="pod freed")
    (agent.plugin_dir / "kubelet.sock").unlink()  # registration-socket: serves again
    wait_for(lambda: (agent.plugin_dir / "kubelet.sock").exists(), timeout=5, what="kubelet.sock served again")
    assert plugin.register(R)["ok"]


def test_backoff_doubles_and_unknown_tasks_are_refused(debug_agent: AgentProcess) -> None:
    agent = debug_agent
    assert inject(agent, "no-such-task") == 404
    assert inject(agent, "grace-period-expiry") == 200
    wait_for(lambda: readyz(agent) == (200, "ok"), timeout=3, what="first restart")
    assert inject(agent, "grace-period-expiry") == 200
    wait_for(lambda: "restarting in 2s" in readyz(agent)[1], timeout=1, what="doubled backoff shown")
    wait_for(lambda: readyz(agent) == (200, "ok"), timeout=4, what="second restart")
    assert task_restarts(agent)["grace-period-expiry"] == 2.0


def test_fault_hook_is_off_by_default(agent: AgentProcess) -> None:
    assert inject(agent, "grace-period-expiry") == 404  # no such route
    assert readyz(agent) == (200, "ok")
