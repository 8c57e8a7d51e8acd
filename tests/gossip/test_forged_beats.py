"""Items dated far ahead, in excess or twice over: a member's forgeries cost the mesh nothing.

Any member may sign an obituary for any peer. One dated near 2**64 once made its subject's
refutation (`beat + 1`, packed into a u64) raise `struct.error` out of the exchange, and held
the subject dead everywhere else until `forget_after`. The rule (docs/gossip.md): an obituary
about another peer is taken up to ten minutes past the earlier of our clock and the subject's
beat clock; a subject outgrows one about itself up to forty minutes past its own clock.
"""

from __future__ import annotations

import pytest

from meshagent.gossip.config import GossipConfig
from meshagent.gossip.errors import ExchangeError
from meshagent.gossip.exchange import Exchange
from meshagent.gossip.failure import PeerState
from meshagent.gossip.messages import Delta, Digest, Items, encode
from meshagent.gossip.signed import Heartbeat, Obituary
from meshagent.identity.keys import NodeIdentity, peer_id_for
from tests.gossip.support import MESH, exchange, make_state

MINUTE_MS = 60_000
MALLORY = NodeIdentity.generate()


def obituary(subject: str, beat: int, reporter: NodeIdentity = MALLORY) -> bytes:
    return Obituary.sign(reporter, subject, beat, MESH).to_cbor()


def wall_ms(state, now: float) -> int:
    """What `make_state`'s clock reads at `now` (it beat at wall time 1000 + its start)."""
    return int((1000.0 + now) * 1000)


@pytest.mark.parametrize("beat", [2**64 - 1, 2**63 - 1, 2**62])
def test_an_obituary_near_2_64_is_refused_by_its_subject_and_nothing_overflows(beat):
    v = make_state("v")
    before = v.me.beat
    assert v.apply(Items(obituaries=(obituary(v.self_id, beat),)), now=0.5) == []
    assert v.stats.rejected["obituary"] == 1
    assert v.me.beat == before  # not refuted: it could not have been signed honestly


@pytest.mark.parametrize("lead_ms", [2**64 - 1, 2**40, 11 * MINUTE_MS])
def test_an_obituary_dated_past_what_its_subject_could_have_sent_is_refused(lead_ms):
    q, v = make_state("q"), make_state("v")
    exchange(q, v, now=0.0)
    beat = min(v.me.beat + lead_ms, 2**64 - 1)
    q.apply(Items(obituaries=(obituary(v.self_id, beat),)), now=0.5)
    assert q.entries[v.self_id].state is PeerState.ALIVE
    assert q.entries[v.self_id].obituary is None
    assert q.stats.rejected["obituary"] == 1


def test_an_obituary_within_the_lead_is_refuted_and_the_refutation_taken_everywhere():
    q, r, v = make_state("q"), make_state("r"), make_state("v")
    for x, y in [(q, v), (r, v), (q, r)]:
        exchange(x, y, now=0.0)
    q.apply(Items(obituaries=(obituary(v.self_id, v.me.beat + 9 * MINUTE_MS),)), now=0.5)
    assert q.entries[v.self_id].state is PeerState.DEAD
    exchange(q, v, now=1.0)  # v hears of it and beats past it
    exchange(v, r, now=1.5)
    exchange(r, q, now=2.0)
    for n in (q, r):
        assert n.entries[v.self_id].state is PeerState.ALIVE


def test_forged_obituaries_cannot_ratchet_their_subject_ahead():
    # Each refutation beats past the obituary; were the bound taken from the subject's latest
    # beat, every forgery could push its beats forty minutes further, without end.
    v = make_state("v")
    for i in range(50):
        forged = obituary(v.self_id, v.me.beat + 39 * MINUTE_MS, NodeIdentity.generate())
        v.apply(Items(obituaries=(forged,)), now=0.01 * i)
    assert v.me.beat <= wall_ms(v, 0.5) + 40 * MINUTE_MS + 1


def test_a_heartbeat_near_2_64_is_refused_and_declaring_its_signer_dead_cannot_overflow():
    q, p = make_state("q"), make_state("p")
    exchange(q, p, now=0.0)
    huge = Heartbeat.sign(p.identity, 2**64 - 1, MESH).to_cbor()
    q.apply(Items(beats=(huge,)), now=0.5)
    assert q.stats.rejected["heartbeat"] == 1
    # The largest beat taken: declaring its signer dead dates the obituary past it, in range.
    top = Heartbeat.sign(p.identity, 2**63 - 1, MESH).to_cbor()
    q.apply(Items(beats=(top,)), now=0.5)
    assert q.entries[p.self_id].beat == 2**63 - 1
    q.declare_dead(p.self_id, now=1.0, reason="test")
    assert q.entries[p.self_id].obituary.beat == 2**63 - 1


def test_obituaries_of_strangers_take_no_room_in_the_table():
    q = make_state("q", config=GossipConfig(max_members=8))
    strangers = [peer_id_for(NodeIdentity.generate().public_key) for _ in range(20)]
    q.apply(Items(obituaries=tuple(obituary(s, 1) for s in strangers)), now=0.5)
    assert list(q.entries) == [q.self_id]
    assert not q.stats.rejected  # nothing to check a signature for


def test_one_delta_carries_one_item_of_a_kind_per_peer():
    q, v = make_state("q"), make_state("v")
    exchange(q, v, now=0.0)
    base = v.me.beat
    obits = tuple(obituary(v.self_id, base + i) for i in range(1, 41))
    q.apply(Items(obituaries=obits), now=0.5)
    assert q.stats.accepted["obituary"] == 1
    assert q.stats.rejected["obituary"] == 39
    assert q.entries[v.self_id].obituary.beat == base + 1


def test_a_delta_with_more_items_of_a_kind_than_members_ends_the_exchange():
    q = make_state("q", config=GossipConfig(max_members=4))
    ex = Exchange(q, initiator=True)
    ex.start()
    items = Items(beats=tuple(b"x" for _ in range(5)))
    with pytest.raises(ExchangeError, match="more items of one kind than 4 members"):
        ex.receive_data(encode(Delta(items)), now=0.5)


def test_an_exchange_after_a_refused_forgery_goes_on():
    # The forgery is refused inside the exchange, which completes: what came with it counts.
    q, v, w = make_state("q"), make_state("v"), make_state("w")
    exchange(q, v, now=0.0)
    exchange(w, v, now=0.0)
    responder = Exchange(v, initiator=False)
    reply = responder.receive_data(encode(Digest(tuple(w.digest()))), now=0.5)
    assert reply
    forged = Items(beats=(w.me.heartbeat.to_cbor(),), obituaries=(obituary(v.self_id, 2**64 - 1),))
    assert responder.receive_data(encode(Delta(forged)), now=0.5) == b""
    assert responder.done
    assert v.stats.rejected["obituary"] == 1
