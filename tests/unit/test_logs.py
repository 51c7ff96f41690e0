"""Both log formats carry the fields of a call (`extra=`), its exception, and nothing of logging's own."""

from __future__ import annotations

import json
import logging

from deviceplane.logs import JsonFormatter, TextFormatter


def record(msg: str, exc: bool = False, **fields: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    made = logging.LogRecord("deviceplane.test", logging.WARNING, __file__, 1, msg, (), exc_info)
    made.__dict__.update(fields)
    return made


def test_text_lines_carry_every_field_as_key_value() -> None:
    line = TextFormatter().format(
        record("pod admission failed", pod="ns/p", reason="no devices left", count=3, empty="", ok=True)
    )
    assert line == (
        'WARNING deviceplane.test: pod admission failed pod=ns/p reason="no devices left" count=3 empty="" ok=true'
    )


def test_text_multiline_fields_and_exceptions_follow_indented() -> None:
    stacks = '--- thread MainThread ---\n  File "x.py", line 1, in block_event_loop\n'
    text = TextFormatter().format(record("event loop stalled", exc=True, stalled_seconds=2.5, stacks=stacks))
    first, *rest = text.split("\n")
    assert first == "WARNING deviceplane.test: event loop stalled stalled_seconds=2.5"
    assert rest[0] == "  stacks:"
    assert rest[1] == "    --- thread MainThread ---"
    assert rest[2] == '      File "x.py", line 1, in block_event_loop'
    assert "  exception:" in rest
    assert rest[-1] == "    ValueError: boom"


def test_json_and_text_carry_the_same_fields() -> None:
    made = record("devices released", uid="u1", entries=2, reason="pod terminated")
    as_json = json.loads(JsonFormatter().format(made))
    text = TextFormatter().format(made)
    for key in ("uid", "entries", "reason"):
        assert key in as_json
        assert f" {key}=" in text
    assert "levelname" not in as_json and "levelname=" not in text
