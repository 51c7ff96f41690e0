"""A real Prometheus server (Debian's `prometheus`, on 127.0.0.1) scrapes a real agent: the alerting query
`deviceplane_device_health == 0` returns exactly the unhealthy devices, and follows health flips and removals."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.procs import AgentProcess, TestPlugin, free_port, wait_for
from tests.support.required import unavailable

GPU = "example.com/gpu"
NIC = "example.com/nic"
UNHEALTHY_QUERY = "deviceplane_device_health == 0"


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            unavailable("prometheus missing: run `make promtool` (Debian package prometheus)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": "deviceplane-agent", "static_configs": [{"targets": [target]}]}],
                }
            )
        )
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def get(self, path: str) -> object:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:
            return json.loads(response.read())

    def unhealthy(self) -> set[tuple[str, str, str]]:
        answer = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": UNHEALTHY_QUERY}))
        assert isinstance(answer, dict) and answer["status"] == "success", answer
        return {
            (r["metric"]["node"], r["metric"]["resource_name"], r["metric"]["device_id"])
            for r in answer["data"]["result"]
        }

    def target_up(self) -> bool:
        answer = self.get("/api/v1/targets")
        assert isinstance(answer, dict)
        return any(t["health"] == "up" for t in answer["data"]["activeTargets"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus(short_tmp: Path) -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        server = Prometheus(short_tmp, target)
        started.append(server)
        wait_for(lambda: server.target_up(), timeout=60, interval=0.2, what=f"prometheus scraping ({server.log})")
        return server

    yield start
    for server in started:
        server.stop()


def test_prometheus_query_returns_exactly_the_unhealthy_devices(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin], prometheus: Callable[[str], Prometheus]
) -> None:
    gpus = plugin_factory(agent.plugin_dir, "gpu.sock", [["g0", "Healthy"], ["g1", "Unhealthy"], ["g2", "Unhealthy"]])
    gpus.register(GPU)
    nics = plugin_factory(agent.plugin_dir, "nic.sock", [["n0", "Unhealthy"], ["n1", "Healthy"]])
    nics.register(NIC)
    wait_for(lambda: agent.counts(GPU) == (3, 1) and agent.counts(NIC) == (2, 1))

    server = prometheus(agent.url.removeprefix("http://"))
    node = "test-node"
    wait_for(
        lambda: server.unhealthy() == {(node, GPU, "g1"), (node, GPU, "g2"), (node, NIC, "n0")},
        timeout=30,
        interval=0.5,
        what="the unhealthy devices in Prometheus",
    )

    # g0 turns unhealthy, g1 recovers, g2 is removed (its series goes stale), n0 recovers.
    gpus.devices([["g0", "Unhealthy"], ["g1", "Healthy"]])
    nics.devices([["n0", "Healthy"], ["n1", "Healthy"]])
    wait_for(lambda: agent.counts(GPU) == (2, 1) and agent.counts(NIC) == (2, 2))
    wait_for(
        lambda: server.unhealthy() == {(node, GPU, "g0")},
        timeout=30,
        interval=0.5,
        what="Prometheus to follow the health changes",
    )
