"""Round-trip times between cities, for simulated meshes spread over the world.

Approximate public ping figures between major hosting cities (the kind that looking-glass and
ping-matrix sites publish), rounded to 5 ms: a stand-in for measured RTTs, not a measurement of
ours. Peers in one city are a few milliseconds apart (home broadband and the metro network).
"""

from __future__ import annotations

import random

CITIES = (
    "London", "Paris", "Frankfurt", "Amsterdam", "New York", "Chicago", "San Francisco",
    "Sao Paulo", "Tokyo", "Singapore", "Mumbai", "Sydney",
)  # fmt: skip

# The upper triangle, row by row, in the order of CITIES (ms).
_UPPER = (
    (10, 15, 10, 70, 90, 140, 190, 225, 170, 115, 265),
    (10, 10, 80, 95, 145, 195, 230, 160, 110, 275),
    (10, 85, 100, 150, 200, 230, 160, 110, 280),
    (80, 95, 145, 195, 235, 165, 120, 270),
    (20, 65, 115, 160, 230, 190, 200),
    (50, 135, 140, 210, 210, 190),
    (175, 105, 170, 230, 150),
    (260, 320, 300, 310),
    (70, 130, 110),
    (60, 90),
    (150,),
)

RTT_MS: dict[tuple[str, str], float] = {}
for _i, _row in enumerate(_UPPER):
    for _j, _ms in enumerate(_row, start=_i + 1):
        RTT_MS[CITIES[_i], CITIES[_j]] = RTT_MS[CITIES[_j], CITIES[_i]] = float(_ms)


def rtt(a: str, b: str, rng: random.Random) -> float:
    """A round trip between a peer in city `a` and one in `b`: the cities' figure, or 2-15 ms
    within one city, with a little jitter."""
    base = rng.uniform(2.0, 15.0) if a == b else RTT_MS[a, b]
    return round(base * rng.uniform(0.95, 1.1), 2)
