"""`python -m deviceplane operator` as a real process with the ServiceAccount identity of manifests/ (shared by
tests/e2e/test_operator.py and benchmarks/operator.py)."""

from __future__ import annotations

import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procs import free_port

from .cluster import REPO, Cluster, http_ok
from .procs import Proc, Procs, wait_for

OPERATOR_USER = "system:serviceaccount:deviceplane-system:deviceplane-operator"
OPERATOR_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:deviceplane-system")


@dataclass
class Operator:
    cluster: Cluster
    procs: Procs
    kubeconfig: Path
    args: tuple[str, ...] = ()  # more flags (e.g. --peering)
    env: tuple[tuple[str, str], ...] = ()  # more environment (e.g. DEVICEPLANE_DEBUG_FAULTS=1)
    proc: Proc | None = None
    metrics_url: str = ""
    health_url: str = ""

    def start(self) -> None:
        health, metrics = free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "deviceplane",
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            "--liveness",
            f"http://127.0.0.1:{health}/healthz",
            "--metrics-addr",
            f"127.0.0.1:{metrics}",
            *self.args,
        ]
        self.proc = self.procs.start("deviceplane-operator", argv, cwd=REPO, env=dict(self.env))
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.health_url = f"http://127.0.0.1:{health}/healthz"
        wait_for("operator /healthz", lambda: http_ok(self.health_url), procs=[self.proc], timeout=60)

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc)
            self.proc = None

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def writes(self) -> list[dict[str, Any]]:
        """Mutating requests the operator's identity sent, from the apiserver's audit log."""
        return [e for e in self.cluster.audit_events() if e.get("user", {}).get("username") == OPERATOR_USER]
