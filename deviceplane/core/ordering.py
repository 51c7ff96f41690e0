"""Natural order of device IDs ("dev-2" before "dev-10"), shared by the agent's allocator and the plugins.

Kept in a module of its own with no imports beyond `re`: plugins import it, and pulling the allocator (and with it
the protobuf and checkpoint modules) into every plugin process measurably slowed the sim plugin's answers.
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"(\d+)")


def natural_key(device_id: str) -> tuple[tuple[int, int | str], ...]:
    """dev-2 before dev-10: choices are deterministic (upstream's are random) and read naturally."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(device_id) if part)
