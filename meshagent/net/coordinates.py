"""Network coordinates (Vivaldi, with a height), sans-IO: the RTT between two peers that have
never measured it, estimated from where each sits.

Each agent holds a coordinate: a point in two dimensions plus a *height* (the delay of its own
access link, which every path from it pays) and an *error*, how far off its estimates have
been lately. After measuring an RTT to a peer whose coordinate it knows, it moves its point
toward or away from the peer's, by as much as the two errors say it should trust the sample
over what it holds (Dabek, Cox, Kaashoek and Morris, "Vivaldi: a decentralized network
coordinate system", SIGCOMM 2004). The estimate between two coordinates is the distance of
their points plus both heights. Agents publish their coordinate in their record, so a planner
can price a pair of peers that are not connected: with a bounded set of connections most
pairs are not.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

CE = 0.25  # how fast the error follows the samples' relative error
CC = 0.25  # how far one sample moves the point, at equal errors
MIN_HEIGHT = 0.1  # ms
MAX_ERROR = 1.5  # a new coordinate's error: it trusts any peer's over its own
LIMIT_MS = 100_000.0  # no coordinate or height beyond this (a peer's is refused beyond it)


@dataclass(frozen=True)
class Coordinate:
    x: float = 0.0
    y: float = 0.0
    height: float = MIN_HEIGHT
    error: float = MAX_ERROR

    def to_wire(self) -> list[float]:
        return [round(self.x, 2), round(self.y, 2), round(self.height, 2), round(self.error, 3)]

    @classmethod
    def from_wire(cls, v: object) -> Coordinate | None:
        """A peer's published coordinate, or None where it is not a sane one."""
        if not isinstance(v, list | tuple) or len(v) != 4:
            return None
        if not all(isinstance(f, int | float) and not isinstance(f, bool) for f in v):
            return None
        x, y, h, e = (float(f) for f in v)
        if not all(math.isfinite(f) for f in (x, y, h, e)):
            return None
        if abs(x) > LIMIT_MS or abs(y) > LIMIT_MS or not 0 <= h <= LIMIT_MS or not 0 <= e <= 10:
            return None
        return cls(x, y, max(h, MIN_HEIGHT), e)


def estimate_ms(a: Coordinate, b: Coordinate) -> float:
    """The RTT the two coordinates predict."""
    return math.hypot(a.x - b.x, a.y - b.y) + a.height + b.height


def update(
    mine: Coordinate, theirs: Coordinate, rtt_ms: float, rng: random.Random | None = None
) -> Coordinate:
    """`mine` after a measured round trip of `rtt_ms` to a peer at `theirs`."""
    if not rtt_ms > 0 or not math.isfinite(rtt_ms):
        return mine
    w = mine.error / max(mine.error + theirs.error, 1e-9)
    predicted = estimate_ms(mine, theirs)
    relative = abs(predicted - rtt_ms) / rtt_ms
    error = min(MAX_ERROR, relative * CE * w + mine.error * (1 - CE * w))
    delta = CC * w * (rtt_ms - predicted)  # > 0: move away (the peer is farther than held)
    dx, dy = mine.x - theirs.x, mine.y - theirs.y
    norm = math.hypot(dx, dy)
    if norm < 1e-6:  # the same point: push apart in a random direction
        angle = (rng or random).uniform(0, 2 * math.pi)
        dx, dy, norm = math.cos(angle), math.sin(angle), 1.0
    plane = norm + mine.height + theirs.height
    x = mine.x + delta * dx / plane
    y = mine.y + delta * dy / plane
    height = max(MIN_HEIGHT, mine.height + delta * (mine.height + theirs.height) / plane)
    clamp = lambda f: max(-LIMIT_MS, min(LIMIT_MS, f))  # noqa: E731
    return Coordinate(clamp(x), clamp(y), min(height, LIMIT_MS), error)


class CoordinateKeeper:
    """An agent's own coordinate, moved by every RTT it measures to a peer with a coordinate,
    and whether it has moved enough since it was last published to publish it again."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.coord = Coordinate()
        self.published: Coordinate | None = None
        self._rng = rng or random.Random()

    def observe(self, theirs: Coordinate, rtt_ms: float) -> None:
        self.coord = update(self.coord, theirs, rtt_ms, self._rng)

    def to_publish(self) -> tuple[float, ...] | None:
        """The coordinate to publish now, or None: not yet trusted, or little moved."""
        c, p = self.coord, self.published
        if c.error >= MAX_ERROR:
            return None
        if p is not None and (
            math.hypot(c.x - p.x, c.y - p.y) + abs(c.height - p.height) < 2.0
            and abs(c.error - p.error) < 0.1
        ):
            return None
        self.published = c
        return tuple(c.to_wire())
