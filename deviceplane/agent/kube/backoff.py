"""Exponential backoff with jitter for retrying API requests (the agent keeps retrying, it never gives up)."""

from __future__ import annotations

import random
from collections.abc import Callable

# Retries while the Node does not exist (yet): the growing backoff reached 30 s, so Node status and NodeDevices
# appeared up to 30 s after their Node. A missing Node is short-lived (an agent started before the registration, a
# Node re-created).
NODE_MISSING_RETRY_MAX_SECONDS = 2.0


class Backoff:
    def __init__(
        self, initial: float = 0.5, maximum: float = 30.0, factor: float = 2.0, rng: Callable[[], float] = random.random
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._rng = rng
        self._next = initial

    def delay(self) -> float:
        """The next wait: grows by `factor` up to `maximum`, each with up to 20% jitter (agents on many nodes
        retrying after one API server outage should not come back in lockstep)."""
        current = self._next
        self._next = min(self.maximum, current * self.factor)
        return current * (0.8 + 0.2 * self._rng())

    def reset(self) -> None:
        self._next = self.initial
