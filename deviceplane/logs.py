"""Structured logs on stderr: one JSON object per line with the `extra=` fields of each call, or (`--log-format text`)
a line for people: `LEVEL logger: message key=value ...`, with multi-line fields (stacks, tracebacks) indented on the
lines below it."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """The same fields as the JSON form: one-line values as key=value (quoted when they hold spaces or quotes),
    multi-line ones after the line, indented, so a reader sees what the JSON reader sees."""

    def format(self, record: logging.LogRecord) -> str:
        line = [f"{record.levelname} {record.name}: {record.getMessage()}"]
        blocks = []
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        for key, value in fields.items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if "\n" in text:
                blocks.append(f"  {key}:\n" + "".join(f"    {row}\n" for row in text.rstrip("\n").split("\n")))
            elif text == "" or any(c in text for c in ' "='):
                line.append(f"{key}={json.dumps(text)}")
            else:
                line.append(f"{key}={text}")
        return " ".join(line) + ("\n" + "".join(blocks).rstrip("\n") if blocks else "")


def setup(level: str = "info", json_format: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
