"""A real Prometheus server (Debian's `prometheus`, on 127.0.0.1) scrapes a real agent: the alerting query
`deviceplane_device_health == 0` returns exactly the unhealthy devices, and follows health flips and removals; the
shipped alerting rules (manifests/extras/monitoring) load, evaluate without error on the agent's real series, and
put exactly the unhealthy devices' alert in pending."""

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
import yaml

from tests.support.procs import AgentProcess, TestPlugin, free_port, wait_for
from tests.support.required import unavailable

GPU = "example.com/gpu"
NIC = "example.com/nic"
UNHEALTHY_QUERY = "deviceplane_device_health == 0"
RULES = Path(__file__).resolve().parents[2] / "manifests" / "extras" / "monitoring" / "deviceplane-rules.yaml"


class Prometheus:
    def __init__(self, workdir: Path, target: str, rules: Path | None = None) -> None:
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
                    "rule_files": [str(rules)] if rules is not None else [],
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

    def rule_health(self) -> dict[str, dict[str, str]]:
        """Loaded rule groups: each rule's health after its last evaluation ("ok", "err: ..." or "unknown")."""
        answer = self.get("/api/v1/rules")
        assert isinstance(answer, dict) and answer["status"] == "success", answer
        health: dict[str, dict[str, str]] = {}
        for group in answer["data"]["groups"]:
            for rule in group["rules"]:
                error = f": {rule['lastError']}" if rule.get("lastError") else ""
                health.setdefault(group["name"], {})[rule["name"]] = rule["health"] + error
        return health

    def alerts(self, name: str) -> set[tuple[str, str, str, str]]:
        """(state, resource, device, severity) of each active alert called `name`."""
        answer = self.get("/api/v1/alerts")
        assert isinstance(answer, dict) and answer["status"] == "success", answer
        return {
            (a["state"], a["labels"]["resource_name"], a["labels"]["device_id"], a["labels"]["severity"])
            for a in answer["data"]["alerts"]
            if a["labels"]["alertname"] == name
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
        server = Prometheus(short_tmp, target, RULES)
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
    # The shipped rules: every one evaluates on the real series without error, and the unhealthy devices' alert is
    # pending (its `for: 5m` not yet over) for exactly those devices.
    wait_for(
        lambda: (
            server.alerts("DeviceplaneDeviceUnhealthy")
            == {("pending", GPU, "g1", "warning"), ("pending", GPU, "g2", "warning"), ("pending", NIC, "n0", "warning")}
        ),
        timeout=30,
        interval=0.5,
        what="the DeviceplaneDeviceUnhealthy alerts pending",
    )
    health = wait_for(  # every rule evaluated at least once (each second here)
        lambda: (h := server.rule_health()) and all(s != "unknown" for g in h.values() for s in g.values()) and h,
        timeout=10,
        interval=0.5,
        what="every rule evaluated",
    )
    shipped = {g["name"]: {r["alert"] for r in g["rules"]} for g in yaml.safe_load(RULES.read_text())["groups"]}
    assert {name: set(rules) for name, rules in health.items()} == shipped, health
    assert {s for g in health.values() for s in g.values()} == {"ok"}, health

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
