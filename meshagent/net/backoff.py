"""Dial retry schedule: exponential backoff with jitter, bounded attempts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.2  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]
    attempts: int = 6

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The sleeps between consecutive attempts (attempts - 1 of them)."""
        rng = rng or random.Random()
        delay = self.initial
        for _ in range(self.attempts - 1):
            yield min(self.maximum, delay) * rng.uniform(1 - self.jitter, 1 + self.jitter)
            delay *= self.factor
