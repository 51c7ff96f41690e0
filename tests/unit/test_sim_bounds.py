"""Every bounded number of the sim (sim_bounds.BOUNDS), through its real entry points: the `deviceplane` argument
parser and the control endpoint (its aiohttp app, in process). Out of range it is refused with a message naming the
field, and nothing is set; in range it is taken as given."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplane.cli import build_parser
from deviceplane.plugin.sim import SimPlugin, non_negative_float
from deviceplane.plugin.sim_bounds import BOUNDS, Bound
from deviceplane.plugin.sim_control import build_app

# Where each bounded field is given: a flag (its argument from the value's text) and/or a control request's body.
FLAGS = {
    "count": ("--count", "{}"),
    "numa": ("--numa", "{}"),
    "rate": ("--flap-rate", "{}"),
    "port": ("--control", "127.0.0.1:{}"),
}
REQUESTS = {
    "rate": ("/flap", lambda value: {"rate": value}),
    "seconds": ("/faults/Allocate", lambda value: {"mode": "hang", "seconds": value}),
    "times": ("/faults/Allocate", lambda value: {"mode": "fail", "times": value}),
}
BOUND = {bound.name: bound for bound in BOUNDS}


def test_every_bounded_field_has_an_entry_point_here() -> None:
    assert set(FLAGS) | set(REQUESTS) == set(BOUND)


def test_the_ranges_are_those_checked_field_by_field_before() -> None:
    before = {
        "count": (int, 0, 233_016),
        "numa": (int, 0, 233_016),
        "rate": (float, 0, 1000),
        "port": (int, 0, 65535),
        "seconds": (float, 0, 86_400),
        "times": (int, 1, 1_000_000),
    }
    assert {name: (bound.kind, bound.low, bound.high) for name, bound in BOUND.items()} == before


def out_of_range(bound: Bound[Any]) -> st.SearchStrategy[float]:
    if bound.kind is int:
        return st.integers(max_value=int(bound.low) - 1) | st.integers(min_value=int(bound.high) + 1)
    return (
        st.floats(max_value=bound.low, exclude_max=True)  # -inf included
        | st.floats(min_value=bound.high, exclude_min=True)  # inf included
        | st.just(math.nan)
    )


def in_range(bound: Bound[Any]) -> st.SearchStrategy[float]:
    if bound.kind is int:
        return st.integers(int(bound.low), int(bound.high))
    return st.floats(bound.low, bound.high)


def flag_cases(values: Any) -> st.SearchStrategy[tuple[str, float]]:
    return st.sampled_from(sorted(FLAGS)).flatmap(lambda name: st.tuples(st.just(name), values(BOUND[name])))


def request_cases(values: Any) -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(sorted(REQUESTS)).flatmap(lambda name: st.tuples(st.just(name), values(BOUND[name])))


def parse_sim_args(name: str, value: float) -> tuple[Any, str]:
    """The parsed namespace (None when refused) and what the parser wrote to stderr."""
    flag, argument = FLAGS[name]
    # --flag=TEXT: argparse would take a lone "-1e+300" or "-inf" for an option.
    argv = ["plugin", "sim", f"{flag}={argument.format(value)}"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return build_parser(argv).parse_args(argv), stderr.getvalue()
        except SystemExit as exit_:
            assert exit_.code == 2
            return None, stderr.getvalue()


@settings(max_examples=300, deadline=None)
@given(flag_cases(out_of_range))
def test_a_flag_out_of_range_is_refused_naming_it(case: tuple[str, float]) -> None:
    name, value = case
    args, stderr = parse_sim_args(name, value)
    assert args is None
    assert f"deviceplane plugin sim: error: argument {FLAGS[name][0]}: " in stderr, stderr  # argparse names the flag
    assert name != "port" or "PORT" in stderr, stderr  # and the part of HOST:PORT


@settings(max_examples=200, deadline=None)
@given(flag_cases(in_range))
def test_a_flag_in_range_is_taken(case: tuple[str, float]) -> None:
    name, value = case
    args, stderr = parse_sim_args(name, value)
    assert args is not None, stderr
    taken = {"count": args.count, "numa": args.numa, "rate": args.flap_rate, "port": (args.control or (0, None))[1]}
    assert taken[name] == value


@pytest.fixture
def control() -> Iterator[tuple[asyncio.Runner, TestClient[Any, Any], SimPlugin]]:
    """The control app of a sim that is not served (the bounded requests only set its fields)."""
    sim = SimPlugin("example.com/sim", 4, 1, plugin_dir="/nonexistent")

    async def start() -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = TestClient(TestServer(build_app(sim)))
        await client.start_server()
        return client

    with asyncio.Runner() as runner:
        client = runner.run(start())
        try:
            yield runner, client, sim
        finally:
            runner.run(client.close())


def put(runner: asyncio.Runner, client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, Any]:
    async def request() -> tuple[int, Any]:
        async with client.put(path, json=body) as response:
            return response.status, await response.json()

    return runner.run(request())


def test_a_control_value_out_of_range_or_of_another_kind_is_refused_naming_it(control: Any) -> None:
    runner, client, sim = control

    @settings(max_examples=300, deadline=None)
    @given(request_cases(lambda bound: out_of_range(bound) | st.booleans() | st.text() | st.none().map(lambda _: [])))
    def refused(case: tuple[str, Any]) -> None:
        name, value = case
        path, body = REQUESTS[name]
        status, answer = put(runner, client, path, body(value))
        assert status == 400, answer
        assert answer["error"].startswith(f"{name} must be {BOUND[name].described()}, got "), answer
        assert sim.flap_rate == 0 and sim.faults == {}

    refused()


def test_a_control_value_in_range_is_taken(control: Any) -> None:
    runner, client, sim = control

    @settings(max_examples=200, deadline=None)
    @given(request_cases(in_range))
    def taken(case: tuple[str, float]) -> None:
        name, value = case
        path, body = REQUESTS[name]
        assert put(runner, client, path, body(value)) == (200, {"ok": True})
        fault = sim.faults.pop("Allocate", None)
        assert {"rate": sim.flap_rate, "seconds": fault and fault.seconds, "times": fault and fault.remaining}[
            name
        ] == value

    taken()


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "-1", "-0.5", "1e400", "soon"])
def test_not_a_finite_number_from_0_is_refused(text: str) -> None:
    """The demo's --duration: the one unbounded above, so the only one the finiteness check is for."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"^(must be a finite number >= 0, got|not a number:) "):
        non_negative_float(text)


@pytest.mark.parametrize(("text", "value"), [("0", 0.0), ("2.5", 2.5), ("1e300", 1e300)])
def test_a_finite_number_from_0_is_taken(text: str, value: float) -> None:
    assert non_negative_float(text) == value
