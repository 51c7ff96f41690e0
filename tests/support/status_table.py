"""Reading `deviceplane status`'s table output in tests."""

from __future__ import annotations

COLUMNS = ("CONDITION", "STATUS", "REASON", "SINCE", "MESSAGE")


def condition_rows(text: str) -> dict[str, list[str]]:
    """The conditions table's rows by type: [status, reason, since, age, message], cut at the header's columns (a
    message keeps its own spacing); SINCE reads `<time> (<age> ago)`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("CONDITION "))
    header = lines[start]
    edges = [header.index(name) for name in COLUMNS]
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        kind, status, reason, since, message = (
            line[left:right].strip() for left, right in zip(edges, [*edges[1:], len(line)], strict=True)
        )
        time, _, age = since.partition(" (")
        rows[kind] = [status, reason, time, age.removesuffix(" ago)"), message]
    return rows
