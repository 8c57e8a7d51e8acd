"""Round-trip time estimates from PING/PONG samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RttSnapshot:
    """Seconds. `smoothed` is an EWMA with gain 1/8 (as TCP's SRTT); None before a sample."""

    latest: float | None
    smoothed: float | None
    minimum: float | None
    samples: int


class RttEstimator:
    GAIN = 0.125

    def __init__(self) -> None:
        self._latest: float | None = None
        self._smoothed: float | None = None
        self._min: float | None = None
        self._samples = 0

    def add(self, sample: float) -> None:
        sample = max(sample, 0.0)
        self._latest = sample
        self._samples += 1
        if self._smoothed is None:
            self._smoothed = sample
        else:
            self._smoothed += self.GAIN * (sample - self._smoothed)
        self._min = sample if self._min is None else min(self._min, sample)

    def snapshot(self) -> RttSnapshot:
        return RttSnapshot(self._latest, self._smoothed, self._min, self._samples)
