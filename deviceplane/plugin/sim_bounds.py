"""The sim's bounded numbers, in one table, and the one check both of its entry points run on them.

Each `Bound` states a field's type and inclusive range. The command line parses its flags with `Bound.parse` (an
argparse type: argparse names the flag, the message says what the text should have been); the control endpoint checks
JSON values with `Bound.check` (ValueError, a 400, whose message starts with the field's name).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from deviceplane.plugin.devices import MAX_MESSAGE_BYTES

# No device takes fewer bytes of a ListAndWatch message (field tag and length, a 5-character id, "Healthy"): more
# devices can never fit in one, and are refused before a list that long is built. Whether a count fits is decided on
# the size of the list with every device unhealthy, the longest form, so that no health change can overflow
# (sim_layout.all_unhealthy_message_bytes).
MIN_DEVICE_BYTES = 18
MAX_COUNT = MAX_MESSAGE_BYTES // MIN_DEVICE_BYTES

Number = TypeVar("Number", int, float)


def _shown(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


@dataclass(frozen=True)
class Bound(Generic[Number]):
    """A number from `low` to `high`, both included; a float must also be finite (NaN compares false with all)."""

    name: str  # as messages call it: the control endpoint's JSON key, else the flag's or its part's name
    kind: type[Number]
    low: float
    high: float
    unit: str = ""  # what it counts, in messages: "flips per second"
    why: str = ""  # why the upper limit, in the command line's message

    def _fits(self, value: float) -> bool:
        # An int is finite (and math.isfinite would overflow on a huge one, which JSON may carry).
        return self.low <= value <= self.high and (isinstance(value, int) or math.isfinite(value))

    def parse(self, text: str) -> Number:
        """argparse type: the number `text` writes, or ArgumentTypeError saying what was expected."""
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {self._a_kind()}: {text!r}") from None
        if self._fits(value):
            return value
        if value > self.high:  # never true of NaN
            unit = f" {self.unit}" if self.unit else ""
            why = f" ({self.why})" if self.why else ""
            raise argparse.ArgumentTypeError(f"must be <= {_shown(self.high)}{unit}{why}, got {text}")
        finite = "a finite number " if self.kind is float else ""
        raise argparse.ArgumentTypeError(f"must be {finite}>= {_shown(self.low)}, got {text}")

    def check(self, value: object) -> Number:
        """A JSON value, as the kind, if in range; else ValueError naming the field and its range."""
        # bool is an int to Python (`true` was 1 time); an int will do for a float, a float not for an int.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (self.kind is int and isinstance(value, float))
            or not self._fits(value)
        ):
            raise ValueError(f"{self.name} must be {self.described()}, got {value!r}")
        return self.kind(value)

    def described(self) -> str:
        """The range in words: 'a number of flips per second from 0 to 1000'."""
        unit = f" of {self.unit}" if self.unit else ""
        return f"{self._a_kind()}{unit} from {_shown(self.low)} to {_shown(self.high)}"

    def _a_kind(self) -> str:
        return "an integer" if self.kind is int else "a number"


COUNT = Bound("count", int, 0, MAX_COUNT, why="a 4 MiB ListAndWatch message")
NUMA = Bound("numa", int, 0, MAX_COUNT, why="no more than the most devices")
# Each flip is a snapshot to every ListAndWatch stream: beyond this the sim only spins (a rate of 1e9 slept 1 ns).
FLAP_RATE = Bound("rate", float, 0.0, 1000.0, unit="flips per second")
PORT = Bound("port", int, 0, 65535)
# An injected hang longer than a day is a mistake (and NaN, which passed `< 0`, slept for no time at all).
FAULT_SECONDS = Bound("seconds", float, 0.0, 86_400.0)
FAULT_TIMES = Bound("times", int, 1, 1_000_000)

BOUNDS = (COUNT, NUMA, FLAP_RATE, PORT, FAULT_SECONDS, FAULT_TIMES)

# Not the sim's: the demo's --duration, and any other finite number >= 0.
NON_NEGATIVE = Bound("value", float, 0.0, math.inf)
