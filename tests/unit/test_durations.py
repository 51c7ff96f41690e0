"""core.durations and its collector against prometheus_client's own Histogram as the oracle: the same buckets,
counts, sum and exposition."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deviceplane.agent.serving.duration_metrics import DurationsCollector
from deviceplane.agent.serving.metrics import ADMISSION_BUCKETS
from deviceplane.agent.state.journal import SYNC_BUCKETS
from deviceplane.core.durations import BucketedDurations

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def oracle(bounds: tuple[float, ...], values: list[float]) -> tuple[list[int], float]:
    registry = CollectorRegistry()
    histogram = Histogram("x_seconds", "x", buckets=bounds, registry=registry)
    for value in values:
        histogram.observe(value)
    (family,) = registry.collect()
    buckets = [int(s.value) for s in family.samples if s.name.endswith("_bucket")]
    total = next(s.value for s in family.samples if s.name.endswith("_sum"))
    return buckets, total


@given(st.lists(st.one_of(st.sampled_from([0.0, *BOUNDS]), st.floats(0, 5, allow_nan=False)), max_size=60))
def test_counts_and_sum_match_prometheus_client(values: list[float]) -> None:
    durations = BucketedDurations(BOUNDS)
    for value in values:
        durations.observe(value)
    buckets, total = durations.cumulative()
    expected_buckets, expected_total = oracle(BOUNDS, values)
    assert buckets == expected_buckets
    assert total == pytest.approx(expected_total)


def test_a_value_on_a_bound_is_in_that_bucket() -> None:
    durations = BucketedDurations(BOUNDS)
    durations.observe(0.01)
    assert durations.cumulative() == ([0, 1, 1, 1, 1], 0.01)


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)])
def test_bounds_must_increase(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketedDurations(bounds)


@pytest.mark.parametrize("bounds", [ADMISSION_BUCKETS, SYNC_BUCKETS])
def test_the_exposition_is_client_pythons(bounds: tuple[float, ...]) -> None:
    """DurationsCollector writes what prometheus_client's own Histogram writes for the same observations."""
    values = [bounds[0] / 2, bounds[0], bounds[3], bounds[-1] * 2]
    durations = BucketedDurations(bounds)
    for value in values:
        durations.observe(value)
    ours = CollectorRegistry()
    ours.register(DurationsCollector("x_seconds", "x", ("result",), {("ok",): durations}))
    theirs = CollectorRegistry()
    histogram = Histogram("x_seconds", "x", ["result"], buckets=bounds, registry=theirs)
    for value in values:
        histogram.labels("ok").observe(value)
    created = b"x_seconds_created"
    expected = b"\n".join(line for line in generate_latest(theirs).splitlines() if created not in line)
    assert generate_latest(ours).rstrip(b"\n") == expected.rstrip(b"\n")
