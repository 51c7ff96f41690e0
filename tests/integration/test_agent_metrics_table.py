"""A real standalone agent's `/metrics`: every `deviceplane_*` family it exports is in the README's table with the
table's type and labels, and every row not marked `cluster mode:` / `proxy mode:` is exported (those are checked
against their collectors in tests/unit/test_docs_metrics_table.py); its `<name>_created` gauges are the ones
docs/agent.md (Metrics) lists."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.support.metrics_table import created_of, documented, exported, mismatches
from tests.support.procs import AgentProcess, TestPlugin, wait_for

R = "example.com/gpu"
AGENT_DOC = Path(__file__).resolve().parents[2] / "docs" / "agent.md"


def created_gauges_listed() -> set[str]:
    """The `_created` gauges named in docs/agent.md's Metrics section."""
    text = AGENT_DOC.read_text()
    metrics = text[text.index("\n## Metrics\n") : text.index("\n## Failure behaviour\n")]
    return set(re.findall(r"`(deviceplane_\w+_created)`", metrics))


def test_a_standalone_agent_exports_the_readme_table(
    agent: AgentProcess, plugin_factory: Callable[..., TestPlugin]
) -> None:
    plugin = plugin_factory(agent.plugin_dir, "p.sock", [["g0", "Healthy"], ["g1", "Healthy"]])
    plugin.register(R)
    wait_for(lambda: agent.counts(R) == (2, 2))
    plugin.devices([["g0", "Unhealthy"], ["g1", "Healthy"]])  # a health transition, so that family has a series
    wait_for(lambda: agent.metric("deviceplane_device_health_transitions_total", resource_name=R, device_id="g0"))
    families = exported(agent.get_text("/metrics"))
    table = documented()
    assert mismatches(table, families) == []
    assert {name for name, row in table.items() if not row.mode} - set(families) == set()
    created = {name for name in families if created_of(name, table)}
    listed = created_gauges_listed()
    assert created - listed == set(), "exported, and not in docs/agent.md's list of _created gauges"
    # A labelled family has its gauge once it has a series: Allocate, never called here, is the one without.
    assert listed - created == {"deviceplane_device_plugin_alloc_duration_seconds_created"}
