"""Natural order of device IDs ("dev-2" before "dev-10"), shared by the agent's allocator and the plugins.

Kept in a module of its own with no imports beyond `re` and `functools`: plugins import it, and pulling the allocator
(and with it the protobuf and checkpoint modules) into every plugin process measurably slowed the sim plugin's answers.
"""

from __future__ import annotations

import functools
import re

# ASCII digits only: `\d` and str.isdigit() also take superscripts and other scripts' digits (int() refuses some).
_DIGITS = re.compile(r"([0-9]+)")


PartKey = tuple[int, int, str] | tuple[int, str]


def natural_key(device_id: str) -> tuple[PartKey, ...]:
    """dev-2 before dev-10: choices are deterministic (upstream's are random) and read naturally.

    A digit run compares as its number would, by (length without leading zeros, digits): no int() of a plugin's
    string, which refuses runs over 4,300 digits."""
    return tuple(_part_key(part) for part in _DIGITS.split(device_id) if part)


def _part_key(part: str) -> PartKey:
    if "0" <= part[0] <= "9":
        digits = part.lstrip("0")
        return (0, len(digits), digits)
    return (1, part)


# Allocation and preferred allocation sort the same IDs again and again: their keys are worth caching (bounded, so
# a plugin announcing ever new IDs cannot grow it without limit).
cached_natural_key = functools.lru_cache(maxsize=1 << 16)(natural_key)
