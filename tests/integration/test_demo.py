"""`deviceplane demo` (what `make demo` runs), as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import ROOT, child_env, hold_down


def demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deviceplane", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env() | {"COLUMNS": "100"},
        cwd=ROOT,
    )


def workdir_of(output: str) -> Path:
    match = re.search(r"deviceplane demo in (\S+)", output)
    assert match, output
    return Path(match.group(1))


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def row(section: str, device: str) -> str:
    lines = [line for line in section.splitlines() if line.startswith("│") and f" {device} " in line]
    assert len(lines) == 1, section
    return lines[0]


def test_demo_with_duration_shows_tables_and_the_flip():
    proc = demo("--duration", "3")
    started = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert "Traceback" not in out + err

    before, _, after = out.partition("after the changes")
    assert after, out
    # Initial table: both resources connected, every sim device healthy on its NUMA node.
    assert re.search(r"example\.com/sim\s+│\s+connected\s+│\s+8\s+│\s+8\s+│\s+8\s+│", before), before
    assert re.search(r"example\.com/cola\s+│\s+connected\s+│\s+3\s+│\s+3\s+│\s+3\s+│", before), before
    for i in range(8):
        assert re.search(rf"sim-{i}\s+│\s+Healthy\s+│\s+{i // 4}\s+│", row(before, f"sim-{i}")), before
    assert "Healthy -> Unhealthy, seen by the agent" in out
    # After: the flip and the new file, as the agent reports them.
    assert "Unhealthy" in row(after.split("static pods")[0], "sim-3")
    assert "Healthy" in row(after.split("static pods")[0], "can-3")
    assert re.search(r"example\.com/sim\s+│\s+connected\s+│\s+8\s+│\s+7\s+│\s+7\s+│", after), after
    # Static pods (the agent admits them since the allocation issue landed): two sim devices packed on one NUMA node,
    # the best fit - node 0, whose 3 healthy devices (sim-3 is not) hold them, leaving node 1's 4 whole - and one
    # cola file.
    pods = out.partition("static pods written")[2]
    trainer = re.search(r"demo/trainer\s+│\s+yes\s+│\s+train\s+│\s+example\.com/sim: (sim-\d),(sim-\d)", pods)
    assert trainer, out
    assert {int(device_id.removeprefix("sim-")) // 4 for device_id in trainer.groups()} == {0}
    assert re.search(r"demo/reader\s+│\s+yes\s+│\s+read\s+│\s+example\.com/cola: can-\d", pods), out
    assert "demo/trainer/train" in row(pods, trainer.group(1))
    assert "watching for changes (for 3s)" in out
    assert time.monotonic() - started >= 3

    workdir = workdir_of(out)
    assert not workdir.exists()
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.parametrize(
    ("sig", "step", "times"),
    [
        (signal.SIGINT, "watching for changes (Ctrl-C to stop)", 1),
        (signal.SIGTERM, "watching for changes (Ctrl-C to stop)", 1),
        # Mid-walkthrough, and a user pressing Ctrl-C again and again: the stop is acted on between steps, so it
        # never lands inside a library call (a KeyboardInterrupt raised there could leave Popen's lock held).
        (signal.SIGINT, "starting the agent", 1),
        (signal.SIGINT, "starting plugins", 5),
        (signal.SIGTERM, "marking sim-3 unhealthy", 1),
    ],
)
def test_demo_stops_on_signal_and_cleans_up(sig, step, times):
    proc = demo()
    assert proc.stdout is not None
    output = ""
    deadline = time.monotonic() + 90
    while step not in output:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, output + (proc.stderr.read() if proc.stderr else "")
        output += line
    for _ in range(times):
        proc.send_signal(sig)
        time.sleep(0.02)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, output + rest + err
    assert "stopped" in rest and "Traceback" not in rest + err
    workdir = workdir_of(output)
    assert not workdir.exists()
    assert processes_mentioning(str(workdir)) == []


def test_demo_bad_duration():
    proc = demo("--duration", "-1")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "must be a finite number >= 0" in err and "Traceback" not in err


def test_demo_absorbs_a_ctrl_c_held_down_until_it_has_exited():
    """SIGINT every 10 ms from mid-walkthrough until the demo exits: the stop and its cleanup finish (exit 0, the
    workdir removed) however late in the exit a repeated Ctrl-C lands. CI once saw the fifth of a quick burst arrive
    after the demo had put the default handlers back: KeyboardInterrupt, exit 130."""
    proc = demo()
    assert proc.stdout is not None
    output = ""
    deadline = time.monotonic() + 90
    while "starting plugins" not in output:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, output + (proc.stderr.read() if proc.stderr else "")
        output += line
    signals = hold_down(proc, signal.SIGINT, interval=0.01)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, f"after {signals} signals:\n" + output + rest + err
    assert "stopped" in rest and "Traceback" not in rest + err
    workdir = workdir_of(output)
    assert not workdir.exists()
    assert processes_mentioning(str(workdir)) == []
