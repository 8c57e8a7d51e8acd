"""Network coordinates: 300 peers over the cities' RTT table, each measuring eight others
(three near it), place themselves so that the RTT between any two is estimated well enough to
plan with; a peer's published coordinate is checked; placement estimates only between peers
whose coordinates have settled, and a measurement wins over an estimate."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from meshagent.gossip.errors import RecordRejected
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.service import MAX_PUBLISHED_RTTS, fields_to_publish
from meshagent.net.coordinates import Coordinate, CoordinateKeeper, estimate_ms, update
from meshagent.placement.costs import PeerCapacity, rtt_between
from meshagent.testing.city_rtts import CITIES, rtt


def test_three_hundred_peers_place_themselves_from_eight_measures_each():
    rng = random.Random(1)
    n = 300
    city = [rng.choice(CITIES) for _ in range(n)]
    true: dict[tuple[int, int], float] = {}

    def measured(a: int, b: int) -> float:
        key = (min(a, b), max(a, b))
        if key not in true:
            true[key] = rtt(city[a], city[b], rng)
        return true[key]

    neighbours = []
    for i in range(n):
        near = rng.sample([j for j in range(n) if j != i and city[j] == city[i]], 3)
        far = rng.sample([j for j in range(n) if j != i and j not in near], 5)
        neighbours.append(near + far)
    coords = [Coordinate() for _ in range(n)]
    for _ in range(60):
        for i in range(n):
            for j in neighbours[i]:
                sample = measured(i, j) * rng.uniform(0.97, 1.05)
                coords[i] = update(coords[i], coords[j], sample, rng)
    # Settled (placement uses them): nearly all. A peer whose near samples stay far off in
    # relative terms (a 5 ms path estimated at 20) keeps a high error, and is priced as
    # unmeasured.
    assert sum(c.error < 1.0 for c in coords) >= 0.95 * n
    same = [
        estimate_ms(coords[a], coords[b])
        for a in range(n)
        for b in range(a + 1, n)
        if city[a] == city[b]
    ]
    far = [
        abs(estimate_ms(coords[a], coords[b]) - measured(a, b)) / measured(a, b)
        for a in range(0, n, 3)
        for b in range(1, n, 5)
        if a != b and measured(a, b) >= 50
    ]
    assert statistics.median(same) < 30  # peers of one city look near each other
    assert statistics.median(far) < 0.2
    assert sorted(far)[int(0.9 * len(far))] < 0.5


@pytest.mark.parametrize(
    "wire",
    [
        [1.0, 2.0, 3.0],
        [1.0, 2.0, 3.0, 0.5, 1.0],
        [math.nan, 0, 1, 0.5],
        [math.inf, 0, 1, 0.5],
        [1e9, 0, 1, 0.5],
        [0, 0, -1, 0.5],
        [0, 0, 1, 11.0],
        [True, 0, 1, 0.5],
        "1,2,3,4",
        None,
    ],
)
def test_a_peer_coordinate_out_of_bounds_is_refused(wire):
    assert Coordinate.from_wire(wire) is None


def test_a_record_carries_its_coordinate_and_refuses_a_bad_one():
    r = PeerRecord("a" * 26, bytes(32), 1, coord=(1.5, -2.0, 3.25, 0.4))
    assert PeerRecord.from_body(r.to_body()).coord == (1.5, -2.0, 3.25, 0.4)
    assert PeerRecord.from_body(PeerRecord("a" * 26, bytes(32), 1).to_body()).coord == ()
    bad = PeerRecord("a" * 26, bytes(32), 1, coord=(float("nan"), 0.0, 1.0, 0.5))
    with pytest.raises(RecordRejected, match="coord"):
        PeerRecord.from_body(bad.to_body())


def test_placement_estimates_only_between_settled_coordinates_and_prefers_a_measure():
    settled = Coordinate(0.0, 0.0, 1.0, 0.3), Coordinate(30.0, 40.0, 2.0, 0.3)
    a = PeerCapacity("a", 1, 1.0, coord=settled[0])
    b = PeerCapacity("b", 1, 1.0, coord=settled[1])
    assert rtt_between(a, b, unknown=999.0) == pytest.approx(53.0)
    fresh = PeerCapacity("c", 1, 1.0, coord=Coordinate(10.0, 0.0, 1.0, 1.2))
    assert rtt_between(a, fresh, unknown=999.0) == 999.0
    measured = PeerCapacity("a", 1, 1.0, rtt_ms={"b": 12.0}, coord=settled[0])
    assert rtt_between(measured, b, unknown=999.0) == 12.0


class _Rtt:
    def __init__(self, s: float) -> None:
        self.smoothed = s


class _Link:
    def __init__(self, peer: str, ms: float) -> None:
        self.peer_id, self.rtt = peer, _Rtt(ms / 1000)


class _Overlay:
    def __init__(self, links) -> None:
        self._links = links

    def links(self):
        return self._links


def test_a_record_lists_its_nearest_rtts_and_its_coordinate_once_it_has_one():
    links = [_Link(f"p{i:03d}", 5.0 + i) for i in range(60)]
    records = {
        link.peer_id: PeerRecord(link.peer_id, bytes(32), 1, coord=(float(i), 0.0, 2.0, 0.2))
        for i, link in enumerate(links)
    }
    keeper = CoordinateKeeper(random.Random(1))
    changed, published = fields_to_publish(None, None, _Overlay(links), {}, keeper, records.get)
    assert len(changed["rtts_ms"]) == MAX_PUBLISHED_RTTS == len(published)
    assert [p for p, _ in changed["rtts_ms"]] == sorted(f"p{i:03d}" for i in range(32))
    # 60 measures moved it from where it started: it trusts its place enough to publish it.
    assert Coordinate.from_wire(list(changed["coord"])) is not None
    again, _ = fields_to_publish(None, None, _Overlay(links), published, keeper, records.get)
    assert "rtts_ms" not in again  # nothing moved
