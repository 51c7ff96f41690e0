"""Missing test prerequisites: a skip locally, a failure when DEVICEPLANE_E2E=required (CI)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def required() -> bool:
    return os.environ.get("DEVICEPLANE_E2E", "") == "required"


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it when DEVICEPLANE_E2E=required: there, every real part must be present."""
    if required():
        pytest.fail(f"{reason} (DEVICEPLANE_E2E=required)", pytrace=False)
    pytest.skip(reason)
