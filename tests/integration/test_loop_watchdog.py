"""The event-loop watchdog through the real agent process: its loop is held with the debug fault
`POST /debug/fault?block_loop=SECONDS` (`DEVICEPLANE_DEBUG_FAULTS=1`; a `time.sleep` on the loop, as a blocking call
would). A hold past `--loop-stall-seconds` is logged once with the loop thread's stack naming the blocking function,
its end once with its length, counted in /metrics; the agent answers as before; shorter holds count nothing;
`--loop-stall-seconds 0` turns it off. In process: the thread lives exactly as long as the started agent."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deviceplane.agent.app import Agent, AgentConfig
from deviceplane.loop_watchdog import HEARTBEAT_SECONDS, THREAD_NAME
from tests.integration.test_agent_metrics import promtool
from tests.integration.test_supervision import readyz
from tests.support.procs import AgentProcess, wait_for

THRESHOLD = 0.5
STALLS = "deviceplane_agent_event_loop_stalls_total"
LAST_STALL = "deviceplane_agent_event_loop_last_stall_seconds"
STALLED, STILL_STALLED, RESUMED = "event loop stalled", "event loop still stalled", "event loop resumed"


def post_fault(agent: AgentProcess, query: str) -> tuple[int, str]:
    request = urllib.request.Request(f"{agent.url}/debug/fault?{query}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=40) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def watchdog_logs(agent: AgentProcess) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
    return [e for e in entries if e.get("logger") == "deviceplane.loop_watchdog"]


@pytest.fixture
def debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVICEPLANE_DEBUG_FAULTS", "1")


def test_a_held_loop_is_logged_once_with_its_stack_counted_and_the_agent_goes_on(
    debug_env: None, agent_factory: Callable[..., AgentProcess]
) -> None:
    agent = agent_factory("--loop-stall-seconds", str(THRESHOLD))
    assert agent.metric(STALLS) == 0.0 and agent.metric(LAST_STALL) == 0.0  # the series exist from the start

    started = time.monotonic()
    assert post_fault(agent, "block_loop=2") == (200, "event loop blocked for 2s")
    assert time.monotonic() - started >= 2.0  # the answer came after the hold: it was on the loop
    wait_for(lambda: [e["msg"] for e in watchdog_logs(agent)] == [STALLED, RESUMED], timeout=3, what="resumed log")
    stalled, resumed = watchdog_logs(agent)
    assert stalled["level"] == "error" and THRESHOLD < stalled["stalled_seconds"] < 2.0
    loop_section = stalled["stacks"].split("--- thread ")[1]
    assert "[event loop]" in loop_section.splitlines()[0] and "in block_event_loop" in loop_section, stalled["stacks"]
    assert "journal-writer" in stalled["stacks"]  # the other threads are there too
    assert resumed["level"] == "warning" and 2.0 <= resumed["stalled_seconds"] <= 2.0 + HEARTBEAT_SECONDS + 0.5
    assert agent.metric(STALLS) == 1.0
    last = agent.metric(LAST_STALL)
    assert last is not None and last == pytest.approx(resumed["stalled_seconds"], abs=0.001)
    # the heartbeat that ran after the hold was over 1 s late: one observation above that bucket
    within_1s = agent.metric("deviceplane_agent_event_loop_lag_seconds_bucket", le="1.0")
    beats = agent.metric("deviceplane_agent_event_loop_lag_seconds_count")
    assert within_1s is not None and beats is not None and within_1s < beats
    assert readyz(agent) == (200, "ok")

    # a hold under the threshold counts nothing (given the watchdog two polls to see it)
    assert post_fault(agent, "block_loop=0.2")[0] == 200
    time.sleep(2 * THRESHOLD)
    assert [e["msg"] for e in watchdog_logs(agent)] == [STALLED, RESUMED]
    assert agent.metric(STALLS) == 1.0
    exposition = agent.get_text("/metrics")
    result = subprocess.run([promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_every_hold_past_the_threshold_is_counted_even_between_two_polls(
    debug_env: None, agent_factory: Callable[..., AgentProcess]
) -> None:
    """Threshold 2 s, so the thread polls every 0.5 s; a 2.4 s hold leaves the heartbeat overdue past the
    threshold for at most 0.15 s before it runs again, so most polls miss it (before the fix: 0 of 6 counted).
    The heartbeat that ends such a stall reports it; each hold is counted exactly once, whoever saw it."""
    agent = agent_factory("--loop-stall-seconds", "2.0")
    holds = 6
    for _ in range(holds):
        assert post_fault(agent, "block_loop=2.4")[0] == 200
        time.sleep(0.6)
    beats = agent.metric("deviceplane_agent_event_loop_lag_seconds_count")
    within_1s = agent.metric("deviceplane_agent_event_loop_lag_seconds_bucket", le="1.0")
    assert beats is not None and within_1s is not None
    late = beats - within_1s  # heartbeats over 1 s late: the holds, as the loop itself measured them
    assert agent.metric(STALLS) == holds, (agent.metric(STALLS), late)
    stalled = [e for e in watchdog_logs(agent) if e["msg"] == STALLED]
    assert len(stalled) == holds and all(e["stalled_seconds"] > 2.0 for e in stalled), stalled
    last = agent.metric(LAST_STALL)
    assert last is not None and 2.4 <= last <= 2.4 + HEARTBEAT_SECONDS + 0.5


@pytest.mark.parametrize(
    "query",
    ["block_loop=abc", "block_loop=", "block_loop=-1", "block_loop=0", "block_loop=31", "block_loop=1e9",
     "block_loop=nan", "block_loop=inf", "block_loop=1&task=checkpoint-pacer"],
)  # fmt: skip
def test_bad_block_requests_are_refused_and_hold_nothing(
    debug_env: None, agent_factory: Callable[..., AgentProcess], query: str
) -> None:
    agent = agent_factory("--loop-stall-seconds", str(THRESHOLD))
    started = time.monotonic()
    status, text = post_fault(agent, query)
    assert status == 400 and ("block_loop" in text or "one fault per request" in text), (status, text)
    assert time.monotonic() - started < 0.9  # the shortest hold asked for here is 1 s: none was made
    assert readyz(agent) == (200, "ok") and agent.metric(STALLS) == 0.0


def test_zero_turns_the_watchdog_off(debug_env: None, agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--loop-stall-seconds", "0")
    assert agent.metric(STALLS) is None and agent.metric(LAST_STALL) is None  # no watchdog, no series
    assert post_fault(agent, "block_loop=1.5")[0] == 200
    time.sleep(0.5)
    assert watchdog_logs(agent) == []
    assert readyz(agent) == (200, "ok")


def test_the_block_route_is_off_by_default(agent: AgentProcess) -> None:
    assert post_fault(agent, "block_loop=1")[0] == 404  # no such route without DEVICEPLANE_DEBUG_FAULTS=1


def watchdog_threads() -> int:
    return sum(t.name == THREAD_NAME for t in threading.enumerate())


@pytest.mark.parametrize("stall_seconds", [5.0, 0.0])
async def test_the_thread_lives_as_long_as_the_started_agent(short_tmp: Path, stall_seconds: float) -> None:
    config = AgentConfig(
        short_tmp / "dp", short_tmp / "pr.sock", "n", 300, "127.0.0.1:0", loop_stall_seconds=stall_seconds
    )
    agent = Agent(config)
    assert watchdog_threads() == 0  # nothing runs before start
    await agent.start()
    try:
        assert watchdog_threads() == (1 if stall_seconds else 0)
    finally:
        await agent.stop()
    assert watchdog_threads() == 0
