"""Hypothesis settings for the fuzz targets (tests/fuzz): bounded in the normal suite, long with DEVICEPLANE_FUZZ=long.

Each target names its two example counts: the bounded one keeps the whole fuzz suite to about a minute on a 2-core
machine; the long one is tens of thousands of examples per target, for a run before a release.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

LONG = os.environ.get("DEVICEPLANE_FUZZ", "") == "long"


def fuzz_settings(bounded: int, long: int = 20_000, **overrides: Any) -> settings:
    return settings(
        max_examples=long if LONG else bounded,
        deadline=None,  # a 2-core machine shared with other suites: timing is not what these test
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
        derandomize=False,
        **overrides,
    )
