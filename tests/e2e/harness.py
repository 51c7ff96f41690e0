"""The kubelet device-manager harness (tests/k8s/kubelet-harness): a client, and its start, shared by the e2e fixture
(conftest.py `kubelet_harness`) and the fuzz targets that need the kubelet's real device manager."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procs import free_port

from .cluster import http_json, http_ok
from .procs import Proc, Procs, wait_for


@dataclass
class Harness:
    proc: Proc
    url: str
    socket_dir: Path

    def capacity(self) -> dict[str, Any]:
        return dict(http_json(self.url + "/capacity"))

    def admit(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        return dict(http_json(self.url + "/admit", method="POST", body=pod))

    def remove(self, uid: str) -> dict[str, Any]:
        return dict(http_json(self.url + "/remove", method="POST", body={"uid": uid}))


def start_harness(
    procs: Procs,
    exe: Path,
    socket_dir: Path,
    *,
    numa_nodes: int = 1,
    policy: str = "none",
    pod_resources_socket: Path | None = None,
) -> Harness:
    """The real kubelet device manager on <socket_dir>/kubelet.sock, serving HTTP once it listens there."""
    port = free_port()
    argv = [
        str(exe),
        f"--socket-dir={socket_dir}",
        f"--http=127.0.0.1:{port}",
        f"--numa-nodes={numa_nodes}",
        f"--topology-policy={policy}",
    ]
    if pod_resources_socket is not None:  # the kubelet's PodResources v1 server, over the real device manager
        argv.append(f"--pod-resources-socket={pod_resources_socket}")
    p = procs.start("kubelet-harness", argv)
    h = Harness(p, f"http://127.0.0.1:{port}", socket_dir)
    # The harness serves HTTP only after the device manager listens on <socket_dir>/kubelet.sock.
    wait_for("kubelet-harness /healthz", lambda: http_ok(h.url + "/healthz"), procs=[p], timeout=30)
    return h
