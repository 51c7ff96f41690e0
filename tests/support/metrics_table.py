"""The README's table of the agent's series (`| name | type | labels | meaning |`), and an exposition read the same
way, for the tests that hold the two together (tests/unit/test_docs_metrics_table.py,
tests/integration/test_agent_metrics_table.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `(deviceplane_[a-z0-9_]+)` \| (counter|gauge|histogram|summary) \|([^|]*)\| (.*) \|$")


@dataclass(frozen=True)
class Series:
    kind: str
    labels: frozenset[str]
    mode: str  # "cluster", "proxy", or "" for every agent


def documented() -> dict[str, Series]:
    """Table name (counters with their `_total`) -> type, labels and the mode its meaning names first."""
    rows = {}
    for line in README.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels, meaning = match.groups()
            mode = re.match(r"(cluster|proxy) mode:", meaning)
            rows[name] = Series(kind, frozenset(re.findall(r"`(\w+)`", labels)), mode.group(1) if mode else "")
    return rows


def exported(exposition: str) -> dict[str, Series]:
    """The `deviceplane_*` families of an exposition, named as the table names them (prometheus_client's
    `<name>_created` gauges as they are); labels from their samples (none when a labelled family has no series yet)."""
    families = {}
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith("deviceplane_"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = frozenset(label for sample in family.samples for label in sample.labels if label != "le")
        families[name] = Series(family.type, labels, "")
    return families


def created_of(name: str, table: dict[str, Series]) -> str | None:
    """The table's counter or histogram whose `_created` gauge `name` is (prometheus_client writes one per series
    of the counters and histograms it keeps), else None."""
    base = name.removesuffix("_created")
    if base == name:
        return None
    for candidate in (base + "_total", base):
        if candidate in table and table[candidate].kind in ("counter", "histogram"):
            return candidate
    return None


def mismatches(table: dict[str, Series], families: dict[str, Series]) -> list[str]:
    """Each family the table lacks, or has with another type or other labels."""
    problems = []
    for name, family in sorted(families.items()):
        row = table.get(name)
        if row is None and family.kind == "gauge" and created_of(name, table):
            continue
        if row is None:
            problems.append(f"{name} ({family.kind}) is exported but not in the README's table")
        elif row.kind != family.kind:
            problems.append(f"{name}: the table says {row.kind}, exported as {family.kind}")
        elif family.labels and family.labels != row.labels:
            problems.append(f"{name}: the table says labels {sorted(row.labels)}, exported {sorted(family.labels)}")
    return problems
