"""The membership table without I/O: convergence, failure detection, obituaries, restarts."""

from __future__ import annotations

import itertools
import random

import pytest

from meshagent.gossip.config import GossipConfig
from meshagent.gossip.errors import ExchangeError, GossipError
from meshagent.gossip.exchange import Exchange
from meshagent.gossip.failure import PeerState, classify
from meshagent.gossip.messages import Digest, Items, encode
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord
from meshagent.gossip.state import GossipState
from meshagent.identity.keys import NodeIdentity
from tests.gossip.support import FAST, MESH, exchange, make_state


@pytest.mark.parametrize(
    "silent, obit, state",
    [
        (0.0, False, PeerState.ALIVE),
        (2.99, False, PeerState.ALIVE),
        (3.0, False, PeerState.SUSPECT),
        (5.99, False, PeerState.SUSPECT),
        (6.0, False, PeerState.DEAD),
        (0.0, True, PeerState.DEAD),
    ],
)
def test_classify(silent, obit, state):
    assert classify(10.0 + silent, 10.0, announced_dead=obit, config=FAST) is state


def test_two_nodes_learn_each_other_in_one_exchange():
    a, b = make_state("a"), make_state("b")
    ca, cb = exchange(a, b, now=0.5)
    assert [(c.peer_id, c.kind) for c in ca] == [(b.self_id, "joined")]
    assert [(c.peer_id, c.kind) for c in cb] == [(a.self_id, "joined")]
    assert a.views(now=0.5)[b.self_id].record.name == "b"
    assert b.views(now=0.5)[a.self_id].record.name == "a"
    # Nothing new: the next exchange carries no items.
    ia = Exchange(a, initiator=True)
    reply = Exchange(b, initiator=False).receive_data(ia.start(), now=1.0)
    assert len(reply) < 200


def test_membership_spreads_through_a_chain():
    nodes = [make_state(f"n{i}") for i in range(6)]
    for _ in range(5):  # a forward pass moves news one hop backwards
        for x, y in itertools.pairwise(nodes):
            exchange(x, y, now=0.5)
    for n in nodes:
        assert len(n.views(now=0.5)) == 6


def test_newer_record_replaces_older_and_stale_is_ignored():
    a, b = make_state("a"), make_state("b")
    exchange(a, b, now=0.0)
    old = a.me.record
    a.publish(wall_time=2000.0, mem_kv_bytes=123)
    _, cb = exchange(a, b, now=1.0)
    assert [c.kind for c in cb] == ["record"]
    assert b.views(now=1.0)[a.self_id].record.mem_kv_bytes == 123
    assert b.apply(Items(records=(old.raw,)), now=1.0) == []
    assert b.stats.stale["record"] == 1


def test_publish_refuses_unknown_fields():
    a = make_state("a")
    with pytest.raises(GossipError, match="unknown record fields: colour"):
        a.publish(wall_time=1.0, colour="red")


def test_forged_items_are_rejected_and_counted():
    a, b = make_state("a"), make_state("b")
    mallory = NodeIdentity.generate()
    forged_beat = Heartbeat(a.identity.public_key, 10**15, mallory.sign(b"x" * 10))
    forged_obit = Obituary(a.self_id, 10**15, mallory.public_key, mallory.sign(b"y"))
    changes = b.apply(
        Items(beats=(forged_beat.to_cbor(),), obituaries=(forged_obit.to_cbor(), b"junk")),
        now=0.0,
    )
    assert changes == []
    # The obituary is of a peer b does not know: nothing to declare dead, no signature checked.
    assert b.stats.rejected == {"heartbeat": 1, "obituary": 1}
    assert b.stats.stale["obituary"] == 1
    assert a.self_id not in b.entries


def test_silent_peer_goes_suspect_then_dead_and_the_obituary_spreads():
    a, b, c = make_state("a"), make_state("b"), make_state("c")
    for x, y in [(a, b), (b, c), (a, c)]:
        exchange(x, y, now=0.0)
    # c falls silent; a and b keep beating and exchanging.
    states = []
    for t in range(1, 8):
        for n in (a, b):
            n.beat(now=t, wall_time=1000 + t)
        exchange(a, b, now=t)
        a.tick(now=t)
        states.append(a.entries[c.self_id].state)
    assert states[:2] == [PeerState.ALIVE] * 2
    assert states[2:5] == [PeerState.SUSPECT] * 3
    assert states[5] is PeerState.DEAD
    assert a.entries[c.self_id].obituary.reporter == a.self_id
    assert c.self_id not in a.views(now=7) and c.self_id in a.views(now=7, include_dead=True)
    # b learns of the death from a before its own timer would have said so.
    b2 = make_state("b2")
    exchange(a, b2, now=7.0)
    assert b2.entries[c.self_id].state is PeerState.DEAD


def test_a_peer_refutes_its_own_obituary_and_comes_back():
    a, c = make_state("a"), make_state("c")
    exchange(a, c, now=0.0)
    for t in range(1, 8):
        a.tick(now=t)
    assert a.entries[c.self_id].state is PeerState.DEAD
    old_beat = c.me.beat
    exchange(a, c, now=8.0)  # c hears it is dead and beats past the obituary
    assert c.me.beat > old_beat
    changes, _ = exchange(a, c, now=8.5)
    assert any(ch.peer_id == c.self_id and ch.state is PeerState.ALIVE for ch in changes)
    assert a.entries[c.self_id].obituary is None


def test_a_restarted_peer_supersedes_its_old_items():
    ident = NodeIdentity.generate()
    a = make_state("a")
    c1 = GossipState(ident, MESH, FAST, now=0.0)
    c1.publish(wall_time=5000.0, name="c")
    c1.beat(now=0.0, wall_time=5000.0)
    exchange(a, c1, now=0.0)
    for t in range(1, 8):
        a.tick(now=t)
    assert a.entries[ident.peer_id].state is PeerState.DEAD
    # Restarted with the same identity and a clock that went *back*: it still wins, because
    # it outgrows items of its own it hears about.
    c2 = GossipState(ident, MESH, FAST, now=8.0)
    c2.publish(wall_time=4000.0, name="c-again")
    c2.beat(now=8.0, wall_time=4000.0)
    exchange(c2, a, now=8.0)
    exchange(c2, a, now=8.5)
    view = a.views(now=8.5)[ident.peer_id]
    assert view.state is PeerState.ALIVE and view.record.name == "c-again"


def test_dead_peers_are_forgotten_after_forget_after():
    a, c = make_state("a"), make_state("c")
    exchange(a, c, now=0.0)
    a.tick(now=7.0)
    changes = a.tick(now=7.0 + FAST.forget_after)
    assert [ch.kind for ch in changes] == ["forgotten"]
    assert c.self_id not in a.entries


def test_delta_respects_the_byte_budget_liveness_first():
    a = make_state("a")
    others = [make_state(f"n{i}") for i in range(20)]
    for o in others:
        exchange(a, o, now=0.0)
    fresh = make_state("fresh")
    items = a.items_for(fresh.digest(), complete=True, budget=2500, now=0.0)
    size = sum(map(len, items.records + items.beats + items.obituaries))
    assert size <= 2500
    assert len(items.beats) > len(items.records)


def test_member_limit():
    a = make_state("a", config=GossipConfig(max_members=3))
    for i in range(4):
        exchange(a, make_state(f"n{i}"), now=0.0)
    assert len(a.entries) == 3
    assert a.stats.rejected["record:member_limit"] >= 1


def test_exchange_refuses_oversize_and_out_of_order_messages():
    a = make_state("a", config=GossipConfig(max_message=1000))
    ex = Exchange(a, initiator=False)
    with pytest.raises(ExchangeError, match="over the 1000-byte limit"):
        ex.receive_data((5000).to_bytes(4, "big"), now=0.0)
    ex = Exchange(a, initiator=False)
    from meshagent.gossip.messages import Delta

    with pytest.raises(ExchangeError, match="unexpected Delta"):
        ex.receive_data(encode(Delta(Items())), now=0.0)
    ex = Exchange(a, initiator=False)
    out = ex.receive_data(encode(Digest(())), now=0.0)
    assert out
    with pytest.raises(ExchangeError):
        ex.receive_data(encode(Digest(())), now=0.0)


def test_exchange_handles_bytes_split_anywhere():
    a, b = make_state("a"), make_state("b")
    rng = random.Random(1)
    ia, rb = Exchange(a, initiator=True), Exchange(b, initiator=False)
    msg = ia.start()
    for _sender, receiver in [(ia, rb), (rb, ia), (ia, rb)]:
        out = b""
        pos = 0
        while pos < len(msg):
            n = rng.randint(1, 50)
            out += receiver.receive_data(msg[pos : pos + n], now=0.0)
            pos += n
        msg = out
    assert ia.done and rb.done
    assert b.self_id in a.views(now=0) and a.self_id in b.views(now=0)


def test_signed_record_of_self_with_higher_seq_makes_owner_republish():
    ident = NodeIdentity.generate()
    a = GossipState(ident, MESH, FAST, now=0.0)
    a.publish(wall_time=100.0, name="a")
    future = GossipState(ident, MESH, FAST, now=0.0)
    rec = future.publish(wall_time=999.0, name="a-future")
    a.apply(Items(records=(rec.raw,)), now=0.0)
    assert a.me.seq > rec.seq and a.me.record.record.name == "a"
    assert SignedRecord.from_cbor(a.me.record.raw, MESH).seq == a.me.seq


def test_a_leaving_peer_is_dead_at_once_and_a_restart_outgrows_it():
    a, c = make_state("a"), make_state("c")
    exchange(a, c, now=0.0)
    c.leave()
    exchange(c, a, now=0.5)
    assert a.entries[c.self_id].state is PeerState.DEAD
    assert c.me.obituary is not None  # not refuted while leaving
    back = GossipState(c.identity, MESH, FAST, now=1.0)
    back.publish(wall_time=2000.0, name="c")
    back.beat(now=1.0, wall_time=2000.0)
    exchange(back, a, now=1.0)
    assert a.entries[c.self_id].state is PeerState.ALIVE


def test_a_peer_declared_dead_is_dead_at_once_until_it_beats_again():
    a, b = make_state("a"), make_state("b")
    exchange(a, b, now=1.0)
    changes = a.declare_dead(b.self_id, now=1.5, reason="nothing listens where it did")
    assert [(c.peer_id, c.state) for c in changes] == [(b.self_id, PeerState.DEAD)]
    assert a.declare_dead(b.self_id, now=1.6, reason="again") == []  # once is enough
    assert a.declare_dead(a.self_id, now=1.6, reason="never ourselves") == []
    # b was alive after all: it hears of its obituary and outgrows it.
    for t in (2.0, 3.0):
        b.beat(now=t, wall_time=1000.0 + t)
        exchange(a, b, now=t)
    assert a.entries[b.self_id].state is PeerState.ALIVE


def test_a_peer_declared_dead_stays_dead_when_a_heartbeat_it_sent_before_dying_arrives_late():
    # a declares p dead on direct evidence (nothing listens where it did), having last seen an
    # older beat of p than b has: the newer one, sent before p died, reaches a afterwards by
    # way of b. It must not bring p back; only p itself, beating again, can.
    a, b, p = make_state("a"), make_state("b"), make_state("p")
    exchange(a, p, now=0.0)
    exchange(a, b, now=0.0)
    for t in (1.0, 2.0):  # p's last beats reach b only; then p dies
        p.beat(now=t, wall_time=1000.0 + t)
        exchange(b, p, now=t)
    a.declare_dead(p.self_id, now=2.5, reason="nothing listens where it did")
    for t in (2.6, 2.7):
        exchange(b, a, now=t)
        exchange(a, b, now=t)
    assert a.entries[p.self_id].state is PeerState.DEAD
    assert b.entries[p.self_id].state is PeerState.DEAD
    # Were p alive after all, it hears of its obituary and outgrows it.
    exchange(a, p, now=3.0)
    exchange(p, a, now=3.1)
    assert a.entries[p.self_id].state is PeerState.ALIVE
