"""What this agent hears itself beats hearsay, without I/O: an obituary about a peer heard
directly is disputed, and members made up by one peer cannot crowd out real ones."""

from __future__ import annotations

from dataclasses import replace

from structlog.testing import capture_logs

from meshagent.gossip.failure import PeerState
from meshagent.gossip.hearsay import HEARS_WITHIN_S, INTRODUCE_BURST, INTRODUCE_PER_MINUTE
from meshagent.gossip.messages import Items
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord
from meshagent.identity.keys import NodeIdentity
from tests.gossip.support import FAST, MESH, exchange, make_state


def _pair(heard: dict[str, float]):
    """`a`, which hears peers as `heard` says, and `b`, which it has exchanged with."""
    a, b = make_state("a", heard=heard.get), make_state("b")
    exchange(a, b, now=0.5)
    return a, b


def _obituary(subject, *, by: NodeIdentity | None = None) -> bytes:
    """What a member says of `subject`: dead, one beat after its latest."""
    by = by or NodeIdentity.generate()
    return Obituary.sign(by, subject.self_id, subject.me.beat + 1, MESH).to_cbor()


def _dead_in_digest(st, peer_id: str) -> bool:
    return next(d for d in st.digest() if d.peer_id == peer_id).dead


def test_an_obituary_about_a_peer_heard_directly_is_disputed_not_applied():
    heard: dict[str, float] = {}
    a, b = _pair(heard)
    forger = NodeIdentity.generate()
    heard[b.self_id] = 1.5  # a PONG from b half a second ago
    with capture_logs() as logs:
        changes = a.apply(Items(obituaries=(_obituary(b, by=forger),)), now=2.0, source="x")
    assert changes == []
    assert a.entries[b.self_id].state is PeerState.ALIVE
    assert a.entries[b.self_id].obituary is None
    assert not _dead_in_digest(a, b.self_id)  # not passed on as this agent's view
    assert b.self_id in a.views(now=2.0)
    assert a.stats.disputed == 1
    events = [e for e in logs if e["event"] == "gossip.obituary_disputed"]
    assert [(e["issuer"], e["subject"]) for e in events] == [(forger.peer_id, b.self_id)]


def test_an_obituary_about_a_peer_not_heard_directly_is_applied():
    heard: dict[str, float] = {}
    a, b = _pair(heard)
    a.apply(Items(obituaries=(_obituary(b),)), now=2.0, source="x")
    assert a.entries[b.self_id].state is PeerState.DEAD
    assert _dead_in_digest(a, b.self_id)
    assert a.stats.disputed == 0


def test_once_the_link_goes_silent_a_copy_sent_again_is_applied():
    heard: dict[str, float] = {}
    a, b = _pair(heard)
    obit = _obituary(b)
    heard[b.self_id] = 1.0
    a.apply(Items(obituaries=(obit,)), now=1.2, source="x")
    assert a.entries[b.self_id].state is PeerState.ALIVE
    # The link has said nothing since: the same obituary, pushed again, holds.
    later = 1.0 + HEARS_WITHIN_S + 0.1
    a.apply(Items(obituaries=(obit,)), now=later, source="x")
    assert a.entries[b.self_id].state is PeerState.DEAD
    assert _dead_in_digest(a, b.self_id)


def test_a_peer_that_leaves_says_so_itself_and_is_believed_at_once():
    heard: dict[str, float] = {}
    a, b = _pair(heard)
    heard[b.self_id] = 1.9
    b.leave()
    exchange(b, a, now=2.0)
    assert a.entries[b.self_id].state is PeerState.DEAD
    assert a.stats.disputed == 0


def test_a_death_this_agent_finds_itself_is_unchanged():
    heard: dict[str, float] = {}
    a, b = _pair(heard)
    heard[b.self_id] = 0.5  # then silence
    a.tick(now=0.5 + FAST.dead_after)
    assert a.entries[b.self_id].state is PeerState.DEAD
    assert a.entries[b.self_id].obituary is not None


# ----- made-up members -----


def _made_up(n: int, *, beat: int = 1_000_000) -> Items:
    """Records and heartbeats of `n` members nobody runs."""
    records, beats = [], []
    for i in range(n):
        ident = NodeIdentity.generate()
        record = PeerRecord(ident.peer_id, ident.public_key, seq=1 + i, name=f"fake{i}")
        records.append(SignedRecord.sign(record, ident, MESH).raw)
        beats.append(Heartbeat.sign(ident, beat, MESH).to_cbor())
    return Items(records=tuple(records), beats=tuple(beats))


def test_one_peer_introduces_a_burst_of_members_then_so_many_a_minute():
    a = make_state("a", config=replace(FAST, max_members=4 * INTRODUCE_BURST))
    flood = _made_up(INTRODUCE_BURST + 40)
    a.apply(flood, now=1.0, source="forger")
    assert len(a.entries) == 1 + INTRODUCE_BURST
    assert a.stats.rejected["record:introductions"] == 40
    a.apply(flood, now=31.0, source="forger")  # half a minute on
    assert len(a.entries) == 1 + INTRODUCE_BURST + INTRODUCE_PER_MINUTE // 2
    # Another peer has a budget of its own.
    a.apply(flood, now=31.0, source="someone else")
    assert len(a.entries) == 1 + INTRODUCE_BURST + 40


def test_a_peer_speaking_for_itself_needs_no_budget():
    a = make_state("a", config=replace(FAST, max_members=4 * INTRODUCE_BURST))
    b = make_state("b")
    a.apply(_made_up(INTRODUCE_BURST), now=1.0, source=b.self_id)  # its budget, spent
    exchange(b, a, now=1.0)  # then its own record and heartbeat
    assert b.self_id in a.views(now=1.0)


def test_the_members_heard_directly_are_sent_first():
    heard: dict[str, float] = {}
    a = make_state("a", heard=heard.get)
    a.apply(_made_up(10), now=0.5, source="x")
    b = make_state("b")
    heard[b.self_id] = 1.0
    exchange(a, b, now=1.0)
    one_beat = len(a.me.heartbeat.to_cbor()) + 5
    items = a.items_for((), complete=True, budget=64 + 2 * one_beat, now=1.0)
    assert {Heartbeat.decode(raw).peer_id for raw in items.beats} == {a.self_id, b.self_id}


def test_a_real_member_gets_room_in_a_table_full_of_made_up_ones():
    cfg = replace(FAST, max_members=32)
    heard: dict[str, float] = {}
    a = make_state("a", config=cfg, heard=heard.get)
    b = make_state("b", config=cfg)
    heard[b.self_id] = 0.0
    exchange(a, b, now=0.0)
    a.apply(_made_up(100), now=0.5, source="forger")
    assert len(a.entries) == cfg.max_members
    # A new agent connects: this agent hears it, so it gets room; what it hears keeps its.
    real = make_state("real", config=cfg)
    heard[real.self_id] = 1.0
    heard[b.self_id] = 1.0
    exchange(real, a, now=1.0)
    views = a.views(now=1.0)
    assert views[real.self_id].record.name == "real"
    assert b.self_id in views
    assert len(a.entries) == cfg.max_members
    assert a.stats.evicted == 1
    # Its next record is used too.
    real.publish(wall_time=1002.0, name="real-2")
    exchange(real, a, now=2.0)
    assert a.views(now=2.0)[real.self_id].record.name == "real-2"


def test_hearsay_never_takes_room_from_anyone():
    cfg = replace(FAST, max_members=32)
    heard: dict[str, float] = {}
    a = make_state("a", config=cfg, heard=heard.get)
    a.apply(_made_up(100), now=0.5, source="forger")
    before = set(a.entries)
    a.apply(_made_up(5), now=1.0, source="someone else")
    assert set(a.entries) == before
    assert a.stats.rejected["record:member_limit"] == 5 + 100 - (cfg.max_members - 1)


def test_room_is_made_from_the_member_silent_longest():
    cfg = replace(FAST, max_members=4)
    heard: dict[str, float] = {}
    a = make_state("a", config=cfg, heard=heard.get)
    old, new = _made_up(1, beat=1_000_000), _made_up(2, beat=1_000_000)
    a.apply(old, now=0.0, source="x")
    a.apply(new, now=1.0, source="x")
    silent_longest = Heartbeat.decode(old.beats[0]).peer_id
    real = make_state("real", config=cfg)
    heard[real.self_id] = 2.0
    exchange(real, a, now=2.0)
    assert silent_longest not in a.entries
    assert real.self_id in a.entries


def test_with_every_member_heard_directly_a_newcomer_is_refused():
    cfg = replace(FAST, max_members=3)
    heard: dict[str, float] = {}
    a = make_state("a", config=cfg, heard=heard.get)
    peers = [make_state(f"n{i}", config=cfg) for i in range(3)]
    for p in peers:
        heard[p.self_id] = 1.0
        exchange(p, a, now=1.0)
    assert {p.self_id for p in peers[:2]} <= set(a.entries)
    assert peers[2].self_id not in a.entries
