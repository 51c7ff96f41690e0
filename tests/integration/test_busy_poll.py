"""Busy polling in the real agent: while one admission waits for a slow plugin, the agent polls for `--busy-poll` and
then sleeps; with `--busy-poll 0` it never polls. The agent's CPU is read from /proc (user + system ticks), the
polling it reports from `deviceplane_agent_busy_poll_seconds_total`."""

from __future__ import annotations

from pathlib import Path

from tests.support.alloc_env import alloc_env
from tests.support.pods import container, devices_of, pod_manifest, wait_settled, write_pod
from tests.support.procs import cpu_seconds

RES = "example.com/sim"
HANG_SECONDS = 1.5


def _cpu_through_a_slow_allocate(root: Path, busy_poll: str) -> tuple[float, float | None]:
    """The agent's CPU seconds over one admission whose Allocate answers after HANG_SECONDS, and the seconds of
    polling its metric reports."""
    with alloc_env(root) as env:
        agent = env.start_agent("--busy-poll", busy_poll)
        sim = env.sim(RES, 2, 0, "--no-pre-start")
        sim.control("PUT", "/faults/Allocate", {"mode": "hang", "seconds": HANG_SECONDS, "times": 1})
        assert agent.proc is not None
        before = cpu_seconds(agent.proc.pid)
        write_pod(env.pod_dir, "a.json", pod_manifest("a", [container("main", {RES: 1})], uid="uid-a"))
        pod = wait_settled(agent, "a")
        spent = cpu_seconds(agent.proc.pid) - before
        assert pod["admitted"] and len(devices_of(pod, RES)) == 1
        return spent, agent.metric("deviceplane_agent_busy_poll_seconds_total")


def test_a_slow_plugin_costs_the_budget_not_the_wait(short_tmp: Path) -> None:
    cpu, reported = _cpu_through_a_slow_allocate(short_tmp / "on", "400ms")
    # Polled about 0.4 s (less CPU if the CPU was taken from it), then slept: 1.5 s of polling would show.
    assert 0.1 < cpu < 1.0, cpu
    assert reported is not None and 0.2 < reported < 0.41, reported  # never past the budget


def test_no_polling_with_zero(short_tmp: Path) -> None:
    cpu, reported = _cpu_through_a_slow_allocate(short_tmp / "off", "0")
    # The agent's other work in those 1.5 s (a heap settle, the checkpoint) may take a little CPU, never 1.5 s.
    assert reported == 0.0 and cpu < 0.3, (reported, cpu)
