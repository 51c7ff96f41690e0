"""Durations counted into fixed buckets, for a Prometheus histogram read at scrape time, pure.

prometheus_client's Histogram takes a lock and walks its buckets on every observation; this is one binary search and
two additions, cheap enough for the admission path and the journal's writes. One thread observes at a time (the
event loop, or the journal's writer while the loop does not write); a reader on another thread copies the counts
once, so the buckets it reports are consistent with each other (the sum may lag them by one observation).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import pairwise


class BucketedDurations:
    __slots__ = ("_counts", "_sum", "bounds")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or any(later <= earlier for earlier, later in pairwise(bounds)):
            raise ValueError(f"bucket bounds must be given and strictly increasing: {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (Prometheus' le is "<=").
        self._counts[bisect_left(self.bounds, seconds)] += 1
        self._sum += seconds

    def cumulative(self) -> tuple[list[int], float]:
        """Per bound and then +Inf, the observations at or below it; and the sum of all observations."""
        counts = list(self._counts)
        total = self._sum
        running = 0
        out = []
        for count in counts:
            running += count
            out.append(running)
        return out, total
