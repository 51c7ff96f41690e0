"""The ranges the sim's docs state are the ranges its checks apply (`sim_bounds`).

README.md's control-endpoint table and `sim_control`'s docstring write the fault and flap ranges out by hand, for
people with curl; a bound changed in `sim_bounds` without them (or the reverse) fails here. Numbers are compared with
their thousands separators removed (the README writes 86,400, the docstring 86,400 or 1000)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import deviceplane.plugin.sim_control as sim_control
from deviceplane.plugin.sim_bounds import FAULT_SECONDS, FAULT_TIMES, FLAP_RATE, Bound

REPO = Path(__file__).resolve().parents[2]


def without_separators(text: str) -> str:
    """`text` with its whitespace runs made one space and the commas inside numbers dropped (1,000,000 -> 1000000)."""
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", " ".join(text.split()))


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def written(bound: Bound[int] | Bound[float]) -> str:
    return f"{number(bound.low)} to {number(bound.high)}"


README = without_separators((REPO / "README.md").read_text())
DOCSTRING = without_separators(sim_control.__doc__ or "")


@pytest.mark.parametrize(
    ("where", "text", "phrase"),
    [
        ("README.md", README, f"`seconds` {written(FAULT_SECONDS)}"),
        ("README.md", README, f"`times` an integer {written(FAULT_TIMES)}"),
        ("README.md", README, f"random health flips per second, {written(FLAP_RATE)} (so is `--flap-rate`)"),
        ("sim_control", DOCSTRING, f"seconds {written(FAULT_SECONDS)}, times {written(FAULT_TIMES)} (sim_bounds)"),
        ("sim_control", DOCSTRING, f'PUT /flap {{"rate": flips_per_second}} {written(FLAP_RATE)}'),
    ],
)
def test_documented_range_is_the_bound(where: str, text: str, phrase: str) -> None:
    assert phrase in text, f"{where} does not say {phrase!r}: its range and sim_bounds disagree"


def test_separators_are_only_dropped_inside_numbers() -> None:
    assert without_separators("0 to 86,400, times 1 to 1,000,000 (a, b)") == "0 to 86400, times 1 to 1000000 (a, b)"
