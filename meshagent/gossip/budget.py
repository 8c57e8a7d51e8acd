"""A token bucket, sans-IO: `burst` at once, then `rate` a second (callers pass `now`)."""

from __future__ import annotations


class Bucket:
    def __init__(self, burst: int, rate: float, now: float) -> None:
        self.tokens, self.burst, self.rate, self.at = float(burst), burst, rate, now

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.burst

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Buckets:
    """One bucket per key (a peer), made full on first use. Past `kept` keys the full ones
    are forgotten (their keys would start full anyway), so keys that come and go (peers
    under ever new identities) leave no lasting state."""

    def __init__(self, burst: int, rate: float, *, kept: int = 256) -> None:
        self.burst, self.rate, self.kept = burst, rate, kept
        self._buckets: dict[str, Bucket] = {}

    def take(self, key: str, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.kept:
                self._buckets = {k: b for k, b in self._buckets.items() if not b.full(now)}
            bucket = self._buckets[key] = Bucket(self.burst, self.rate, now)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)
