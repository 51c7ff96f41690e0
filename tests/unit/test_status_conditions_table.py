"""`deviceplane status`'s conditions block, from documents an agent could send (the real agent's is in
tests/integration/test_status_cli.py and tests/e2e/test_proxy_visibility.py)."""

from __future__ import annotations

from typing import Any

import pytest

from deviceplane.cli.status import conditions_table, devices_table, human_duration


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(-3, "0s"), (0, "0s"), (59.9, "59s"), (60, "1m"), (302, "5m2s"), (3600, "1h"), (11_040, "3h4m"),
     (86_400, "1d"), (183_600, "2d3h")],
)  # fmt: skip
def test_ages_read_as_kubectls(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def document(*conditions: dict[str, Any], heartbeat: str = "2026-11-28T17:00:00Z") -> dict[str, Any]:
    return {"agent": {"node": "n", "version": "v", "lastHeartbeatTime": heartbeat}, "resources": [],
            "conditions": list(conditions)}  # fmt: skip


def condition(kind: str, status: str, since: str = "2026-11-28T16:58:30Z") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": "Why", "message": "what  exactly", "lastTransitionTime": since}


def test_an_unknown_status_is_named_as_not_true_and_an_odd_time_shown_as_is() -> None:
    text = conditions_table(document(condition("A", "True"), condition("B", "Unknown", since="yesterday")))
    assert text.splitlines() == [
        "conditions: 1 of 2 NOT True: B",
        "CONDITION   STATUS    REASON   SINCE                              MESSAGE",
        "A           True      Why      2026-11-28T16:58:30Z (1m30s ago)   what  exactly",
        "B           Unknown   Why      yesterday                          what  exactly",
    ]


def test_an_agent_that_sends_no_conditions_gets_no_block() -> None:
    assert conditions_table(document()) == ""
    assert devices_table(document()).splitlines()[1].startswith("RESOURCE ")
