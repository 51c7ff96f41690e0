"""The benchmarks still run: each small, in a subprocess, checked for the figures it prints.

Timings are not asserted (benchmarks report them; see benchmarks/README.md): this only keeps the scripts from rotting
when the code they drive changes (benchmarks/proxy.py once waited for a /readyz that proxy mode no longer gives it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT, child_env


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("proxy.py", ["--calls", "30"], "added by proxied                   percentile difference"),
        ("entry_cpu.py", ["--requests", "50", "--pods", "20", "--rounds", "1"], "CPU per admission: agent"),
        ("choice.py", ["--rounds", "1", "--preferred"], "5000 (same)"),
        ("admission_phases.py", ["--rounds", "1", "--pods", "30"], "the floor's two operations in sequence, polling"),
        ("admission_phases.py", ["--rounds", "1", "--pods", "30", "--fine"], "Allocator.commit: the entry made"),
        ("preferred.py", ["--rounds", "1", "--calls", "3"], "   10000     8"),
        ("allocation.py", ["--pods", "20", "--filler", "40"], "8 concurrent, 40 holding"),
        (
            "gc_pauses.py",
            ["--runs", "1", "--reps", "1", "--pods", "8", "--idle", "0", "--held", "24", "--sustained", "40"],
            "heap settles (default): ",
        ),
        ("checkpoint_encode.py", ["--entries", "200", "--rounds", "1"], "the same in slices of 0.5 ms, as the agent"),
        (
            "checkpoint_encode.py",
            ["--entries", "20", "--rounds", "1", "--response", "gpu"],
            "gpu responses of 426 bytes",
        ),
        ("snapshot_churn.py", ["--rounds", "2"], "10,000  5,000  one flips"),
        ("reads.py", ["--devices", "50", "--rounds", "1"], "prometheus_client    first  unchanged  one flip"),
        ("reads.py", ["--agent", "--rounds", "1", "--held", "20"], "GetAllocatableResources  after a change"),
        ("journal_directory.py", ["--rounds", "1", "--pods", "20"], "the watcher woken per admission"),
        ("write_after_idle.py", ["--rounds", "1", "--writes", "5"], "tight loop of writes (the floor's)  write"),
        ("sim_start.py", ["--rounds", "1", "--counts", "0,100"], "     100  "),
        (
            "loop_stalls.py",
            ["--reps", "1", "--pods", "8", "--held", "24", "--sustained", "40", "--threshold", "0"],
            "task AdmissionRunner._admit",
        ),
        (
            "loop_stalls.py",
            [
                "--reps",
                "1",
                "--pods",
                "8",
                "--held",
                "24",
                "--sustained",
                "40",
                "--resource",
                "rpcs",
                "--slow",
                "0.001",
            ],
            "all-RPCs admissions over 1 ms inside the agent",
        ),
        (
            "compare.py",
            [
                "--runs",
                "1",
                "--pods",
                "8",
                "--filler",
                "24",
                "--sustained",
                "40",
                "--releases",
                "2",
                "--only",
                "admission",
                "--out",
                "{tmp}",
            ],
            "8-concurrent admissions/s, 0 held, sustained (3 x 40)",
        ),
    ],
)
def test_benchmark_runs_and_prints_its_figures(script: str, args: list[str], expected: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *(a.format(tmp=tmp_path) for a in args)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout, done.stdout[-3000:]
