"""What each version served in one rollout step's window (pure; the random source is
injected): samples kept in a bounded uniform reservoir, requests and errors counted
(issue 18; compared by :mod:`gateway.traffic.rollout_stats`)."""

from __future__ import annotations

import random


class Reservoir:
    """A uniform sample of at most ``size`` values from a stream (Vitter 1985, algorithm R),
    with the count of values seen."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.seen = 0
        self.values: list[float] = []
        self.strata: list[int] = []  # each value's stratum (gateway.traffic.rollout_strata)
        self._rng = rng

    def add(self, value: float, stratum: int = 0) -> None:
        """Offer one value with its stratum (kept with probability ``size / seen``)."""
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
            self.strata.append(stratum)
            return
        j = self._rng.randrange(self.seen)
        if j < self.size:
            self.values[j] = value
            self.strata[j] = stratum

    @property
    def pairs(self) -> tuple[list[float], list[int]]:
        """(values, strata), parallel."""
        return self.values, self.strata


class Side:
    """What one version served in a window: TTFT and ITL samples (seconds), requests and
    errors (counts)."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.ttft = Reservoir(size, rng)
        self.itl = Reservoir(size, rng)
        self.requests = 0
        self.errors = 0
