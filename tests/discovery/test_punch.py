"""`punch/1`'s messages and what `meshagent peers` says of a relayed peer (`punch.py`)."""

from __future__ import annotations

import cbor2
import pytest

from meshagent.discovery import punch
from meshagent.discovery.punch import PunchError, candidates_of, why_relayed
from meshagent.net.address import Address
from meshagent.wire.framing import LengthPrefixDecoder


def _decode(data: bytes) -> dict:
    frames = LengthPrefixDecoder(punch.FRAMING)
    frames.feed(data)
    return cbor2.loads(frames.next_frame())


def test_offer_round_trip_and_limits():
    msg = _decode(punch.encode(punch.OFFER, ["10.0.0.1:9338", "[fe80::1]:9338"]))
    assert msg[1] == punch.OFFER
    assert candidates_of(msg) == [Address("10.0.0.1", 9338), Address("fe80::1", 9338)]
    many = [f"10.0.0.{i}:9338" for i in range(40)]
    assert len(candidates_of(_decode(punch.encode(punch.ANSWER, many)))) == punch.MAX_CANDIDATES
    assert 2 not in _decode(punch.encode(punch.GO))


@pytest.mark.parametrize(
    "bad",
    [None, "10.0.0.1:9338", [7], ["no-port"], ["x" * 100 + ":1"], ["h:1"] * 17, [["a"]]],
)
def test_a_peer_s_bad_candidates_are_refused_by_name(bad):
    with pytest.raises(PunchError, match="candidate"):
        candidates_of({0: 1, 1: punch.OFFER, 2: bad})


def test_why_a_peer_is_relayed():
    both = why_relayed("dependent", "dependent", punches=3, error="x", punching=True)
    assert "symmetric" in both and "port forward" in both
    assert "peer punches" in why_relayed("independent", "", punches=0, error=None, punching=False)
    assert why_relayed("independent", "independent", punches=0, error=None, punching=True) == (
        "no punch tried yet"
    )
    said = why_relayed("", "", punches=2, error="no candidate answered", punching=True)
    assert said == "2 punches failed; the last: no candidate answered"


def test_punches_back_off_to_a_minute():
    assert [punch.schedule(n, 5.0) for n in (1, 2, 3, 4, 5, 9)] == [5, 10, 20, 40, 60, 60]


def test_the_side_behind_the_more_closed_nat_punches():
    assert punch.punches("dependent", "independent", "b", "a")
    assert not punch.punches("independent", "dependent", "a", "b")
    assert punch.punches("independent", "none", "z", "a")
    assert punch.punches("unknown", "", "a", "b") and not punch.punches("", "unknown", "b", "a")
    # Alike: the lower peer id, and exactly one of the two.
    for mine, theirs in (("dependent", "dependent"), ("none", "none"), ("independent", "")):
        assert punch.punches(mine, theirs, "a", "b") != punch.punches(theirs, mine, "b", "a")


def test_a_spray_host_and_a_public_address_travel_and_are_checked():
    offer = _decode(punch.encode(punch.OFFER, ["10.0.0.1:9338"], "203.0.113.5"))
    assert punch.extra_of(offer) == "203.0.113.5"
    assert punch.extra_of(_decode(punch.encode(punch.ANSWER, []))) is None
    for bad in (7, "", "x" * 65, ["203.0.113.5"]):
        with pytest.raises(PunchError, match="field 3"):
            punch.extra_of({0: 1, 1: punch.OFFER, 2: [], 3: bad})


def test_a_spray_aims_at_distinct_ports_a_nat_may_map_to():
    import random

    ports = punch.spray_ports(punch.SPRAY, random.Random(3))
    assert len(set(ports)) == punch.SPRAY and all(1024 <= p <= 65535 for p in ports)
    assert 0 < punch.spray_size() <= punch.SPRAY


def test_a_spray_only_toward_a_peer_behind_a_symmetric_nat_at_a_host_it_named():
    theirs = [Address("192.168.1.2", 9338), Address("203.0.113.5", 9338)]
    symmetric = {"p"}.__contains__
    assert punch.may_spray_at(symmetric, "p", "203.0.113.5", theirs)
    assert not punch.may_spray_at(symmetric, "q", "203.0.113.5", theirs)  # record says not
    assert not punch.may_spray_at(symmetric, "p", "198.51.100.9", theirs)  # a third party


def test_a_peer_has_its_punches_answered_and_sprays_made_only_so_often():
    a = punch.Answering(most=2)
    assert a.answer("p", 0.0) and not a.answer("p", 0.5) and a.answer("p", 1.0)
    assert a.answer("q", 1.1) and not a.answer("q", 1.5)  # each peer on its own clock
    # Bounded: the peer answered longest ago is forgotten (and may punch again at once).
    assert a.answer("r", 1.2)  # p (at 1.0) and q (at 1.1) were held: p goes
    assert a.answer("p", 1.3)
    assert a.spray("p", 2.0) and not a.spray("p", 5.0) and a.spray("p", 6.0)
    a.spraying = punch.MAX_SPRAYS  # so many under way: none more, whoever asks
    assert not a.spray("q", 10.0)
    a.spraying -= 1
    assert a.spray("q", 10.0)
