"""kopf's request failure lines: the first shown, the rest of each interval held back and counted in the next one
shown; other lines untouched (the whole outage, with kopf's real retries: tests/e2e/test_operator_api_outage.py)."""

from __future__ import annotations

import logging

import pytest

from deviceplane.operator import kopf_network
from deviceplane.operator.kopf_network import RequestFailureLines


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("kopf._cogs.clients.watching", logging.ERROR, __file__, 1, message, None, None)


def test_one_failure_line_per_interval_says_how_many_were_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(kopf_network.time, "monotonic", lambda: now[0])
    lines = RequestFailureLines(interval=60)
    failure = "Request attempt #1/5 failed; will retry: GET https://api/api/v1/nodes?watch=true -> TimeoutError()"
    first = record(failure)
    assert lines.filter(first)
    assert "kopf retries; at most one such line per 60 s" in first.getMessage()
    for _ in range(5):
        now[0] += 10
        assert not lines.filter(record(failure))
    assert lines.filter(record("Watch-stream for nodes is inactive")), "another line was held back"
    now[0] += 11
    later = record(failure)
    assert lines.filter(later)
    assert "5 more failed attempts" in later.getMessage()
