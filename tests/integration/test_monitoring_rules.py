"""The shipped alerting rules (manifests/extras/monitoring): promtool accepts them and their unit tests pass, every
series they name is one the agent or the operator exports, and the PrometheusRule form is generated from them."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest

from deviceplane.agent.kube.publishing import PublishRecord
from deviceplane.agent.proxy.metrics import ProxyCollector
from deviceplane.agent.serving.publish_metrics import NODE_STATUS, NODEDEVICES, PublishCollector
from deviceplane.operator.app import OperatorOptions, operator_metrics
from scripts.gen_prometheus_rule import PROMETHEUS_RULE, RULES, prometheus_rule_text
from tests.support.procs import AgentProcess, TestPlugin, wait_for
from tests.support.required import unavailable

TESTS = RULES.with_name("deviceplane-rules.test.yaml")
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")


def promtool(*args: str | Path) -> str:
    tool = shutil.which("promtool")
    if tool is None:
        unavailable("promtool missing: run `make promtool`")
    done = subprocess.run([tool, *map(str, args)], capture_output=True, text=True, cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def rules() -> list[dict[str, object]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", RULES)
    assert "SUCCESS" in promtool("test", "rules", TESTS)


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    fired = {
        case["alertname"]
        for test in yaml.safe_load(TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == {str(rule["alert"]) for rule in rules()}


def test_the_prometheus_rule_is_generated_from_the_rule_file() -> None:
    assert PROMETHEUS_RULE.read_text() == prometheus_rule_text(), "run: python scripts/gen_prometheus_rule.py"
    document = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert document["kind"] == "PrometheusRule"
    assert document["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def exported_names(exposition: str) -> set[str]:
    """Every series name an exposition can produce, from its TYPE lines (families without samples yet included)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names.update(name + suffix for suffix in HISTOGRAM_SERIES)
    return names


class PodResourcesSeen:
    reachable = True
    last_listed = 1.0


def test_every_series_the_rules_name_is_exported(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy"]])
    plugin.register("example.com/gpu")
    wait_for(lambda: agent.counts("example.com/gpu") == (1, 1))
    operator, _watchdog = operator_metrics(OperatorOptions())  # what build() registers, the watchdog's series too
    operator.track_configs(lambda: [])
    # The agent's cluster-mode series (publishing), which a standalone agent has no reason to export: as app.py
    # registers them (tests/e2e/test_cluster_publishing.py reads them from an agent in a cluster).
    cluster = CollectorRegistry()
    records = {NODE_STATUS: PublishRecord("node status"), NODEDEVICES: PublishRecord("NodeDevices")}
    cluster.register(PublishCollector(records, lambda: 0))
    # Proxy mode's series, as proxy/mode.py registers them (tests/e2e/test_proxy_visibility.py reads them from an
    # agent in front of a real kubelet).
    cluster.register(ProxyCollector("n", PodResourcesSeen(), lambda: ["example.com/gpu"], lambda _resource: True))
    exported = (
        exported_names(agent.get_text("/metrics"))
        | exported_names(generate_latest(operator.registry).decode())
        | exported_names(generate_latest(cluster).decode())
    )
    named = {name for rule in rules() for name in re.findall(r"\bdeviceplane_[a-z_]+", str(rule["expr"]))}
    assert len(named) >= 10 and named <= exported, sorted(named - exported)
