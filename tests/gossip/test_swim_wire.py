"""Membership by probes with real identities: every message through the wire codec, every
update signed by its issuer and checked by its receiver; forged updates and malformed
messages are refused without changing anything."""

from __future__ import annotations

from dataclasses import replace

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord, Suspicion
from meshagent.gossip.swim import Message, State, Swim, SwimConfig, Update
from meshagent.gossip.swim_proofs import SwimProofs
from meshagent.gossip.swim_wire import SwimWireError, decode, encode
from meshagent.identity.keys import NodeIdentity
from tests.gossip.support import MESH

CONFIG = SwimConfig()


class Mesh:
    """A few members over the codec: messages arrive 10 ms after they are sent."""

    def __init__(self, n: int) -> None:
        self.ids = [NodeIdentity.generate() for _ in range(n)]
        self.proofs = {i.peer_id: SwimProofs(i, MESH) for i in self.ids}
        self.members: dict[str, Swim] = {}
        self.now = 0.0
        self.queue: list[tuple[float, str, str, bytes]] = []
        self.down: set[str] = set()
        for k, ident in enumerate(self.ids):
            me = ident.peer_id
            p = self.proofs[me]
            m = Swim(me, config=CONFIG, seed=k, incarnation=1000 + k, sign=p.sign, verify=p.verify)
            record = PeerRecord(me, ident.public_key, seq=1, name=f"m{k}")
            m.publish(SignedRecord.sign(record, ident, MESH).raw, self.now)
            self.members[me] = m
            if k:
                self.send(me, m.join(self.ids[0].peer_id, self.now))

    def send(self, source: str, out) -> None:
        for dest, msg in out:
            self.queue.append((self.now + 0.01, dest, source, encode(msg)))

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = round(self.now + 0.01, 2)
            due = [q for q in self.queue if q[0] <= self.now]
            self.queue = [q for q in self.queue if q[0] > self.now]
            for _, dest, source, data in due:
                if dest not in self.down:
                    self.send(dest, self.members[dest].receive(self.now, source, decode(data)))
            for name, m in self.members.items():
                if name not in self.down and self.now >= m.next_timer():
                    self.send(name, m.tick(self.now))

    def everyone_lists_everyone(self) -> bool:
        names = set(self.members)
        return all(m.alive() == names for m in self.members.values())


def test_signed_members_join_spread_records_and_declare_a_crash_dead():
    mesh = Mesh(5)
    mesh.run(3)
    assert mesh.everyone_lists_everyone()
    for m in mesh.members.values():  # every record reached every member, verified
        assert all(x.record for x in m.members.values())
        assert m.rejected == 0
    victim = mesh.ids[3].peer_id
    mesh.down.add(victim)
    mesh.run(6)
    for name, m in mesh.members.items():
        if name != victim:
            assert m.state_of(victim) == State.DEAD
            proof = Obituary.decode(m.members[victim].proof)
            assert proof.subject == victim and proof.reporter == m.members[victim].issuer


def _forge(mesh: Mesh, forger: NodeIdentity, victim: str) -> list[Update]:
    """Updates `forger` might send about `victim` (whose incarnation it knows)."""
    inc = mesh.members[victim].incarnation
    mine = Heartbeat.sign(forger, inc + 5, MESH).to_cbor()
    suspicion = Suspicion.sign(forger, victim, inc, MESH).to_cbor()
    earlier = Obituary.sign(forger, victim, inc - 1, MESH).to_cbor()
    other, me = mesh.ids[2].peer_id, forger.peer_id
    return [
        Update(victim, inc + 5, State.ALIVE, victim, proof=mine),  # the forger's heartbeat
        Update(victim, inc, State.SUSPECT, other, proof=suspicion),  # claimed as another's
        Update(victim, inc, State.DEAD, me, proof=earlier),  # proved for another incarnation
        Update(victim, inc, State.DEAD, me, proof=suspicion),  # proved by a suspicion
        Update(victim, inc + 9, State.DEAD, me),  # no proof at all
    ]  # fmt: skip


def test_forged_updates_change_nothing_and_are_counted():
    mesh = Mesh(4)
    mesh.run(3)
    forger = mesh.ids[1]
    victim = mesh.ids[3].peer_id
    target = mesh.members[mesh.ids[0].peer_id]
    before = (target.digest(), target.members[victim].state, target.members[victim].incarnation)
    forged = _forge(mesh, forger, victim)
    # A record of the victim's at a newer version, signed by the forger.
    fake = PeerRecord(victim, forger.public_key, seq=7, name="x")
    good = target.members[victim]
    forged.append(
        replace(
            Update(victim, good.incarnation, good.state, good.issuer, 7, b"", good.proof),
            record=cbor2.dumps({0: 1, 1: fake.to_body(), 2: bytes(64)}),
        )
    )
    msg = Message("gossip", updates=tuple(forged))
    target.receive(mesh.now, forger.peer_id, decode(encode(msg)))
    after = (target.digest(), target.members[victim].state, target.members[victim].incarnation)
    assert after == before
    assert target.rejected == len(forged)
    assert mesh.proofs[target.me].last_reason


def test_a_member_refutes_a_signed_suspicion_with_its_own_heartbeat():
    mesh = Mesh(3)
    mesh.run(3)
    accuser, subject = mesh.ids[1], mesh.ids[2].peer_id
    inc = mesh.members[subject].incarnation
    rumour = Update(subject, inc, State.SUSPECT, accuser.peer_id)
    rumour = mesh.proofs[accuser.peer_id].sign(rumour)
    mesh.send(accuser.peer_id, [(subject, Message("gossip", updates=(rumour,)))])
    mesh.run(3)
    assert mesh.members[subject].incarnation == inc + 1
    for m in mesh.members.values():
        assert m.alive() == set(mesh.members)
        if m.me != subject:
            assert m.members[subject].incarnation == inc + 1
            assert m.members[subject].state == State.ALIVE
            assert Heartbeat.decode(m.members[subject].proof).beat == inc + 1


def test_an_agent_signs_only_what_it_may_issue():
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    proofs = SwimProofs(a, MESH)
    with pytest.raises(ValueError, match="only an agent itself"):
        proofs.sign(Update(b.peer_id, 1, State.ALIVE, a.peer_id))
    with pytest.raises(ValueError, match="issues"):
        proofs.sign(Update(b.peer_id, 1, State.DEAD, b.peer_id))


_ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz234567", min_size=1, max_size=26)
_updates = st.builds(
    Update,
    _ids,
    st.integers(0, (1 << 63) - 1),
    st.sampled_from(list(State)),
    _ids,
    st.integers(0, (1 << 63) - 1),
    st.binary(max_size=64),
    st.binary(max_size=128),
)
_messages = st.builds(
    Message,
    st.sampled_from(["ping", "ack", "ping-req", "gossip", "sync", "sync-reply", "pull"]),
    st.integers(0, (1 << 63) - 1),
    st.one_of(st.just(""), _ids),
    st.lists(_updates, max_size=4).map(tuple),
    st.sampled_from([b"", bytes(range(16))]),
    st.lists(_updates, max_size=4).map(tuple),
)


@settings(max_examples=200, deadline=None)
@given(_messages)
def test_every_message_survives_the_codec(m):
    assert decode(encode(m)) == m


_cbor = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.integers(), inner, max_size=4),
    max_leaves=40,
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(_cbor, _messages, st.integers(0, 5), st.integers(0, 6))
def test_a_malformed_message_is_refused_whole(junk, m, field, inner):
    for data in (
        cbor2.dumps(junk),
        _with_field(m, field, junk),
        _with_update_field(m, inner, junk),
    ):
        try:
            got = decode(data)
        except SwimWireError:
            continue
        assert isinstance(got, Message)  # what decodes is a well-formed message
        assert decode(encode(got)) == got


def _with_field(m: Message, field: int, junk) -> bytes:
    d = cbor2.loads(encode(m))
    d[field] = junk
    return cbor2.dumps(d)


def _with_update_field(m: Message, field: int, junk) -> bytes:
    d = cbor2.loads(encode(m))
    u = Update("a", 1, State.ALIVE, "a").wire()
    u[field] = junk
    d[4] = [u]
    return cbor2.dumps(d)


def test_bounds_are_named():
    base = cbor2.loads(encode(Message("ping")))
    for field, value, words in [
        (0, 99, "kind"),
        (1, -1, "seq"),
        (1, True, "seq"),
        (3, b"x" * 15, "digest"),
        (4, [[]] * 2000, "updates"),
        (2, "x" * 65, "target"),
    ]:
        d = list(base)
        d[field] = value
        with pytest.raises(SwimWireError, match=words):
            decode(cbor2.dumps(d))
    with pytest.raises(SwimWireError, match="over"):
        decode(b"\x00" * (5 << 20))
    with pytest.raises(SwimWireError, match="CBOR"):
        decode(b"\xff\xff")
