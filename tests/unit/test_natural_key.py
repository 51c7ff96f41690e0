"""Natural order of device IDs, for any ID a plugin may send (found by the long ListAndWatch fuzz run: "¹" is a
digit to str.isdigit() but not to int(), and int() refuses runs over 4,300 digits)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from deviceplane.core.ordering import natural_key


def test_numbers_compare_as_numbers() -> None:
    ids = ["dev-10", "dev-2", "dev-1", "dev-02", "a", "dev-", "10", "9"]
    assert sorted(ids, key=natural_key) == ["9", "10", "a", "dev-", "dev-1", "dev-2", "dev-02", "dev-10"]


def test_ids_int_cannot_read() -> None:
    huge = "d" + "9" * 5000
    ids = ["x\u00b9", "\u0661", "d2", huge, "d" + "9" * 4999]
    ordered = sorted(ids, key=natural_key)
    assert ordered.index("d2") < ordered.index("d" + "9" * 4999) < ordered.index(huge)


@given(st.lists(st.text(max_size=12), max_size=8))
def test_any_ids_sort(ids: list[str]) -> None:
    assert sorted(sorted(ids, key=natural_key), key=natural_key) == sorted(ids, key=natural_key)


@given(st.integers(0, 10**30), st.integers(0, 10**30))
def test_digit_runs_order_as_their_numbers(a: int, b: int) -> None:
    assert (natural_key(f"d{a}") < natural_key(f"d{b}")) == (a < b)
