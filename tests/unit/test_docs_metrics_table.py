"""Cluster and proxy mode's series (read at scrape time by their collectors) are the README table's rows marked
`cluster mode:` / `proxy mode:`, with the table's types and labels. The standalone agent's are checked against a real
agent in tests/integration/test_agent_metrics_table.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest

from deviceplane.agent.proxy.metrics import ProxyCollector
from deviceplane.agent.serving.publish_metrics import NODE_STATUS, NODEDEVICES, PublishCollector
from tests.support.metrics_table import documented, exported, mismatches


@dataclass
class Record:
    last_success: float = 0.0
    failures: Mapping[int, int] = field(default_factory=dict)
    reachable: bool = True
    last_listed: float = 0.0


def test_cluster_and_proxy_series_are_the_tables() -> None:
    registry = CollectorRegistry()
    registry.register(PublishCollector({NODE_STATUS: Record(), NODEDEVICES: Record()}, lambda: 0))
    registry.register(ProxyCollector("n1", Record(), lambda: ["example.com/sim"], lambda _resource: True))
    families = exported(generate_latest(registry).decode())
    table = documented()
    assert mismatches(table, families) == []
    assert set(families) == {name for name, row in table.items() if row.mode in ("cluster", "proxy")}
