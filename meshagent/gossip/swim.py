"""Membership whose cost per member does not grow with the mesh: SWIM's failure detector with
Lifeguard's suspicion, and changes spread by piggybacking on the probes (sans-IO).

Each member keeps, for every other, an *incarnation* (raised only by that member, to refute a
suspicion of itself), a state (alive, suspect, dead) and the version of its record. Every
`probe_interval` it probes one member (round robin through a shuffled list): a PING, answered
by an ACK within a timeout fitted to the round trips measured to it (`rtt_timeouts` of them,
at most `probe_timeout`); without one, it asks `indirect` other members to probe the target
for it (PING-REQ), and without any answer within `indirect_timeout` more it *suspects* the
target. The indirect probes cross two links each way, which between continents take most of
a second: they run on while the next probes start, so that a lost PING or ACK (a probe in
fifty at 1% loss) is not a suspicion. A suspicion turns into a death after a timeout that
starts at `suspicion_max` and shrinks toward `suspicion_min` as other members' suspicions of
the same target arrive (Lifeguard's confirmations: a member whose own probe of a suspect goes
unanswered spreads its suspicion beside the first, and a few members probe a newly suspected
member at once). A member that hears it is suspected raises its incarnation and
says it is alive, which outranks the suspicion everywhere.

Changes (a member alive at an incarnation, suspected, dead, a new record) are *updates*: each
is piggybacked on this member's next messages, each update `retransmit` x log2(N + 1) times,
most recent first within `max_piggyback` bytes; while updates wait, a GOSSIP message carries
them to `fanout` random members every `gossip_interval`. A joining member pulls the whole
table from its contact (SYNC), and every `sync_interval` each member compares a digest of its
table with a random member's and pulls the entries only where they differ: in a steady mesh a
member sends a probe, an ack and a digest of fixed size, whatever the mesh's size.

The class is a pure state machine: `tick(now)` and `receive(now, source, message)` return the
messages to send as (destination, message) pairs, and `Message.size()` is its encoded size, so
the same code runs over the overlay or over the simulated bus of `meshagent/testing/swim_bus.py`.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import cbor2

from meshagent.gossip.swim_messages import Message, State, SwimConfig, Update
from meshagent.gossip.swim_updates import UpdateQueue


@dataclass
class _Probe:
    """A probe of `target` under way: direct until `direct_until`, then indirect until
    `judged_at`, when it is suspected unless an ACK came."""

    target: str
    started: float
    direct_until: float
    judged_at: float
    indirect_sent: bool = False
    helpers: frozenset[str] = frozenset()  # asked to probe it for us (PING-REQ)


@dataclass
class Member:
    incarnation: int
    state: State
    since: float
    record_seq: int = 0
    record: bytes = b""
    suspectors: set[str] = field(default_factory=set)
    deadline: float = math.inf  # when a suspicion becomes a death
    issuer: str = ""  # who vouched for the current state, and its proof (passed on in tables)
    proof: bytes = b""


_RELAYS = 1024  # PING-REQs relayed and not answered yet, kept at most

Out = list[tuple[str, Message]]
# Attaches this member's proof to an update it issues (its alive, its suspicions and deaths).
Sign = Callable[[Update], Update]
# Whether a received update's proof holds; asked only of an update that would change something.
Verify = Callable[[Update], bool]


def _row_hash(row: tuple) -> int:
    return int.from_bytes(hashlib.blake2b(cbor2.dumps(row), digest_size=16).digest(), "big")


def _outranks(new: Update, old: Member) -> bool:
    """SWIM's order: a higher incarnation wins; at one incarnation, suspect beats alive and
    dead beats both."""
    if new.incarnation != old.incarnation:
        return new.incarnation > old.incarnation
    return new.state.value > old.state.value


class Swim:
    def __init__(
        self,
        me: str,
        *,
        config: SwimConfig | None = None,
        seed: int = 0,
        now: float = 0.0,
        incarnation: int = 0,
        sign: Sign | None = None,
        verify: Verify | None = None,
    ) -> None:
        """`incarnation`: where this member's starts (an agent starts it at the wall clock in
        ms, so that a restart outranks what the mesh remembers of its last run)."""
        self.me = me
        self._sign = sign
        self._verify = verify
        self.rejected = 0  # received updates whose proof did not hold
        self.disputed = 0  # deaths heard of members this member had not suspected
        self._checks: dict[str, tuple[int, float]] = {}  # member -> (ping seq, sent)
        self._later: Out = []  # messages decided while applying updates, sent with the rest
        self.config = config or SwimConfig()
        self.rng = random.Random(seed)
        self.incarnation = incarnation
        self.left = False  # `leave` was called
        self.record_seq = 0
        self.record = b""
        self.members: dict[str, Member] = {}
        self.bytes_sent = 0
        self._updates = UpdateQueue(self.config)  # updates waiting to be piggybacked
        self._order: list[str] = []
        self._seq = 0
        self._probes: dict[int, _Probe] = {}  # our ping seq -> the probe under way
        self._rtt: dict[str, float] = {}  # smoothed round trip of our direct probes, by member
        # our seq -> (asker, its seq, the target we pinged for it)
        self._relays: dict[int, tuple[str, int, str]] = {}
        self._next_probe = now + self.rng.uniform(0, self.config.probe_interval)
        self._next_gossip = now
        self._next_sync = now + self.rng.uniform(0, self.config.sync_interval)
        self._wants: set[str] = set()  # members whose newer record this member lacks
        # The table's digest: the XOR of its rows' hashes, kept as rows change.
        self._digest = _row_hash((self.me, incarnation, 0, 0))
        # Members not known dead, in a list for sampling (with each one's index in it).
        self._live: list[str] = []
        self._live_at: dict[str, int] = {}
        self._suspects: set[str] = set()
        # Whether a member can be sent to now (the agent: it has a connection to it); None:
        # any. Gossip, PING-REQs and syncs go to members it says yes of, where there are any.
        self.reachable: Callable[[str], bool] | None = None
        self.died: list[tuple[float, str]] = []  # (when, member) this member declared dead

    # ----- what the member knows -----

    def alive(self) -> set[str]:
        """Members not known dead (alive or suspect), this one included."""
        return {self.me, *self._live_others()}

    def alive_others(self) -> list[str]:
        """The other members not known dead (not to be changed by the caller)."""
        return self._live

    @property
    def pending_updates(self) -> int:
        """Updates still to be piggybacked (0: this member only probes and syncs)."""
        return len(self._updates)

    def state_of(self, member: str) -> State | None:
        x = self.members.get(member)
        return None if x is None else x.state

    def _n(self) -> int:
        return 1 + len(self._live)

    def digest(self) -> bytes:
        """16 bytes that differ between two members whose tables differ (the XOR of a hash
        of every row, this member's own included)."""
        return self._digest.to_bytes(16, "big")

    def _rows_changed(self, member: str, before: tuple | None, after: tuple | None) -> None:
        """Keep the digest, the live list and the suspects as `member`'s row changes."""
        if before == after:
            return
        if before is not None:
            self._digest ^= _row_hash((member, *before))
        if after is not None:
            self._digest ^= _row_hash((member, *after))
        if member == self.me:
            return
        was_live = before is not None and before[1] != State.DEAD.value
        live = after is not None and after[1] != State.DEAD.value
        if live and not was_live:
            self._live_at[member] = len(self._live)
            self._live.append(member)
        elif was_live and not live:
            self._rtt.pop(member, None)
            i = self._live_at.pop(member)
            last = self._live.pop()
            if last != member:
                self._live[i], self._live_at[last] = last, i
        if after is not None and after[1] == State.SUSPECT.value:
            self._suspects.add(member)
        else:
            self._suspects.discard(member)

    # ----- this member's own changes -----

    def publish(self, record: bytes, now: float, seq: int | None = None) -> None:
        """A new record of this member's, spread to every member; `seq`: its version (the
        record's own, where it carries one; by default the next)."""
        before = self._row(self.me)
        self.record_seq = self.record_seq + 1 if seq is None else max(seq, self.record_seq + 1)
        self.record = record
        self._rows_changed(self.me, before, self._row(self.me))
        self._queue_update(self._self_update(with_record=True))

    def join(self, contact: str, now: float) -> Out:
        """Ask `contact` for its table; it learns of this member from the same message."""
        self._queue_update(self._self_update(with_record=True))
        return self._send([(contact, Message("sync", digest=b"", updates=self._piggyback()))])

    @property
    def _own_state(self) -> State:
        return State.DEAD if self.left else State.ALIVE

    def _self_update(self, *, with_record: bool = False) -> Update:
        return self._issue(
            Update(
                self.me, self.incarnation, self._own_state, self.me, self.record_seq,
                self.record if with_record else b"",
            )
        )  # fmt: skip

    def _issue(self, u: Update) -> Update:
        return u if self._sign is None else self._sign(u)

    def declare_dead(self, member: str, now: float) -> bool:
        """`member` is gone for certain (its process no longer listens): dead here now, and
        spread as any death. False where it is unknown or dead already."""
        x = self.members.get(member)
        if x is None or x.state == State.DEAD:
            return False
        self._apply(self._issue(Update(member, x.incarnation, State.DEAD, self.me)), now)
        return True

    def sync_with(self, member: str) -> Out:
        """A digest of this member's table to `member`, which answers with its own table
        where they differ (anti-entropy now rather than at the next `sync_interval`)."""
        return self._send([(member, Message("sync", digest=self.digest()))])

    def leave(self, now: float, peers: int) -> Out:
        """This member leaves: its own death at its incarnation, to `peers` members (they
        spread it). A restart outranks it with a later incarnation."""
        self.left = True  # from now on it says it is dead, and refutes no death of its own
        u = self._issue(Update(self.me, self.incarnation, State.DEAD, self.me))
        return self._send([(m, Message("gossip", updates=(u,))) for m in self._pick(peers)])

    def flush(self, now: float) -> Out:
        """The updates waiting now, to `fanout` members at once (not at the next tick)."""
        if not self._updates:
            return []
        out: Out = []
        for m in self._pick(self.config.fanout):
            updates = self._piggyback()
            if updates:
                out.append((m, Message("gossip", updates=updates)))
        return self._send(out)

    # ----- timers -----

    def tick(self, now: float) -> Out:
        out: Out = []
        c = self.config
        for m, (_, sent) in sorted(self._checks.items()):
            if now >= sent + c.probe_interval:  # no answer: suspected on this member's word
                del self._checks[m]
                x = self.members.get(m)
                if x is not None and x.state == State.ALIVE:
                    self._apply(self._issue(Update(m, x.incarnation, State.SUSPECT, self.me)), now)
        for m in sorted(self._suspects):
            x = self.members[m]
            if now >= x.deadline:
                self._apply(self._issue(Update(m, x.incarnation, State.DEAD, self.me)), now)
        for seq, p in sorted(self._probes.items()):
            if not p.indirect_sent and now >= p.direct_until:
                p.indirect_sent = True
                helpers = self._pick(c.indirect, but=p.target)
                p.helpers = frozenset(helpers)
                for h in helpers:
                    out.append((h, Message("ping-req", seq, p.target, self._piggyback())))
            if now >= p.judged_at:
                del self._probes[seq]
                x = self.members.get(p.target)
                # Unanswered: a suspicion of ours, or our confirmation of another's (which
                # brings the suspicion's timeout toward its minimum everywhere).
                if x is not None and (
                    x.state == State.ALIVE
                    or (x.state == State.SUSPECT and self.me not in x.suspectors)
                ):
                    suspicion = Update(p.target, x.incarnation, State.SUSPECT, self.me)
                    self._apply(self._issue(suspicion), now)
        if now >= self._next_probe:
            target = self._next_target()
            self._next_probe = now + c.probe_interval
            if target is not None:
                out.append(self._start_probe(target, now))
        if now >= self._next_gossip:
            self._next_gossip = now + c.gossip_interval
            if self._updates:
                for m in self._pick(c.fanout):
                    updates = self._piggyback()
                    if updates:
                        out.append((m, Message("gossip", updates=updates)))
        if now >= self._next_sync:
            self._next_sync = now + c.sync_interval
            for m in self._pick(1):
                out.append((m, Message("sync", digest=self.digest())))
        return self._send(out)

    def next_timer(self) -> float:
        """When `tick` has work next."""
        times = [self._next_probe, self._next_sync]
        if self._updates:
            times.append(self._next_gossip)
        for p in self._probes.values():
            times.append(p.judged_at if p.indirect_sent else p.direct_until)
        times += [self.members[m].deadline for m in self._suspects]
        times += [sent + self.config.probe_interval for _, sent in self._checks.values()]
        return min(times)

    def _live_others(self) -> list[str]:
        return self._live

    def _pick(self, k: int, *, but: str | None = None) -> list[str]:
        """`k` members drawn at random to send to (not `but`): of those `reachable` now,
        where any is, else of every live member."""
        live = self._live if but is None else [m for m in self._live if m != but]
        if self.reachable is not None:
            live = [m for m in live if self.reachable(m)] or live
        return self.rng.sample(live, min(k, len(live)))

    def _start_probe(self, target: str, now: float) -> tuple[str, Message]:
        self._seq += 1
        wait = self._direct_timeout(target)
        judged = now + wait + self.config.indirect_timeout
        self._probes[self._seq] = _Probe(target, now, now + wait, judged)
        return (target, Message("ping", self._seq, updates=self._piggyback()))

    def _direct_timeout(self, target: str) -> float:
        """How long a direct PING to `target` waits for its ACK: `rtt_timeouts` round trips
        as measured, within [`min_probe_timeout`, `probe_timeout`]."""
        c = self.config
        rtt = self._rtt.get(target)
        if rtt is None:
            return c.probe_timeout
        return min(c.probe_timeout, max(c.min_probe_timeout, c.rtt_timeouts * rtt))

    def _next_target(self) -> str | None:
        """The next member of the shuffled round, skipping those dead or already under a
        probe; None when there is none. With `reachable`, the round is of the members it
        says yes of (the agent's connections: each member is probed by those connected to
        it), where there are any."""
        probed = self.probing()
        near = self.reachable
        for refilled in (False, True):
            while self._order:
                m = self._order.pop()
                x = self.members.get(m)
                if x is None or x.state == State.DEAD or m in probed:
                    continue
                if near is None or near(m) or not any(map(near, self._live)):
                    return m
            if refilled:
                return None
            live = list(self._live_others())
            self._order = live if near is None else [m for m in live if near(m)] or live
            self.rng.shuffle(self._order)
        return None

    # ----- messages -----

    def receive(self, now: float, source: str, msg: Message) -> Out:
        for u in (*msg.updates, *msg.entries):
            self._apply(u, now)
        out: Out = []
        if msg.kind == "ping":
            out.append((source, Message("ack", msg.seq, msg.target, self._piggyback())))
        elif msg.kind == "ack":
            # An ACK counts only from whom it was asked of (the sequence numbers are easy to
            # guess): a member answering for another would keep a silent one alive.
            if msg.target:  # an answer to a probe this member made for another
                relay = self._relays.get(msg.seq)
                if relay is not None and relay[2] == source:
                    del self._relays[msg.seq]
                    out.append((relay[0], Message("ack", relay[1], "", self._piggyback())))
            elif msg.seq in self._probes and (
                source == self._probes[msg.seq].target or source in self._probes[msg.seq].helpers
            ):
                p = self._probes.pop(msg.seq)
                if p.target == source:  # the target's own ACK: a direct round trip
                    sample = now - p.started
                    was = self._rtt.get(source)
                    self._rtt[source] = sample if was is None else 0.8 * was + 0.2 * sample
            elif self._checks.get(source, (None,))[0] == msg.seq:
                del self._checks[source]  # it answers: the death was hearsay
        elif msg.kind == "ping-req":
            self._seq += 1
            self._relays[self._seq] = (source, msg.seq, msg.target)
            if len(self._relays) > _RELAYS:  # the oldest were never answered
                del self._relays[next(iter(self._relays))]
            out.append((msg.target, Message("ping", self._seq, msg.target, self._piggyback())))
        elif msg.kind == "sync":
            if msg.digest != self.digest():
                # a joiner (no digest) gets the records too; others pull those they lack
                whole = not msg.digest
                out.append((source, Message("sync-reply", entries=self._table(whole))))
        elif msg.kind == "pull":
            records = [self._record_of(m) for m in msg.target.split(",")]
            out.append((source, Message("gossip", updates=tuple(r for r in records if r))))
        if self._wants:
            wants, self._wants = sorted(self._wants), set()
            out.append((source, Message("pull", target=",".join(wants[:64]))))
        return self._send(out)

    def _record_of(self, member: str) -> Update | None:
        if member == self.me:
            return self._self_update(with_record=True)
        x = self.members.get(member)
        if x is None or not x.record:
            return None
        return Update(member, x.incarnation, x.state, x.issuer, x.record_seq, x.record, x.proof)

    def _table(self, records: bool) -> tuple[Update, ...]:
        rows = [self._self_update(with_record=records)]
        for m, x in sorted(self.members.items()):
            record = x.record if records else b""
            rows.append(Update(m, x.incarnation, x.state, x.issuer, x.record_seq, record, x.proof))
        return tuple(rows)

    def _apply(self, u: Update, now: float) -> None:
        x = self.members.get(u.subject)
        if (
            x is not None
            and u.incarnation == x.incarnation
            and u.state == x.state
            and u.record_seq <= x.record_seq
            and (u.state != State.SUSPECT or u.issuer in x.suspectors)
        ):
            return  # what this member knows already: most updates, as each goes round
        if self._verify is not None and not self._verify(u):
            self.rejected += 1
            return
        before = self._row(u.subject)
        self._take(u, now)
        after = self._row(u.subject)
        self._rows_changed(u.subject, before, after)
        if after is not None and after[1] == State.DEAD.value != (before or (0, 0))[1]:
            self.died.append((now, u.subject))

    def _row(self, member: str) -> tuple | None:
        """What the digest covers of a member: (incarnation, state, record version)."""
        if member == self.me:
            return (self.incarnation, self._own_state.value, self.record_seq)
        x = self.members.get(member)
        return None if x is None else (x.incarnation, x.state.value, x.record_seq)

    def _take(self, u: Update, now: float) -> None:
        if u.subject == self.me:
            if self.left:
                return  # it left: whoever still speaks to it while it drains hears so
            if u.state != State.ALIVE and u.incarnation >= self.incarnation:
                self.incarnation = u.incarnation + 1  # refute: alive, newer than the rumour
                self._queue_update(self._self_update())
            return
        x = self.members.get(u.subject)
        if x is None:
            if u.state == State.DEAD:
                return  # a death of a member never known takes no room
            x = self.members[u.subject] = Member(
                u.incarnation, u.state, now, issuer=u.issuer, proof=u.proof
            )
            if u.record_seq and not u.record:
                self._wants.add(u.subject)
            if u.state == State.SUSPECT:
                self._suspect(x, u, now)
            self._take_record(x, u)
            self._queue_update(u)
            return
        newer_record = u.record_seq > x.record_seq and u.record
        if u.record_seq > x.record_seq and not u.record:
            self._wants.add(u.subject)
        if (
            u.state == State.DEAD
            and u.issuer not in (self.me, u.subject)
            and _outranks(u, x)
            and not (x.state == State.SUSPECT and x.incarnation == u.incarnation)
        ):
            # Another member's word that it died, where this member has not suspected it:
            # this member pings it itself, and suspects it only if that goes unanswered
            # (what a member hears itself beats hearsay). A member that declares others
            # dead at will costs each receiver a ping.
            self._check(u.subject, now)
            self.disputed += 1
            return
        if _outranks(u, x):
            was = x.state
            x.incarnation, x.state = u.incarnation, u.state
            x.issuer, x.proof = u.issuer, u.proof
            if u.state != was:
                x.since = now
            if u.state == State.SUSPECT:
                x.suspectors = set()
                self._suspect(x, u, now)
            else:
                x.suspectors, x.deadline = set(), math.inf
            self._take_record(x, u)
            self._queue_update(u)
        elif (
            u.state == State.SUSPECT
            and x.state == State.SUSPECT
            and u.incarnation == x.incarnation
            and u.issuer not in x.suspectors
        ):
            self._suspect(x, u, now)  # another's suspicion confirms ours: a shorter timeout
            if len(x.suspectors) <= self.config.confirmations + 1:
                self._queue_update(u, confirmation=True)  # and the others count it too
        elif newer_record:
            self._take_record(x, u)
            self._queue_update(u)

    def _check(self, member: str, now: float) -> None:
        """Ping `member` now, unless a check of it is under way (`tick` judges it)."""
        if member in self._checks:
            return
        self._seq += 1
        self._checks[member] = (self._seq, now)
        self._later.append((member, Message("ping", self._seq, updates=self._piggyback())))

    def _take_record(self, x: Member, u: Update) -> None:
        if u.record and u.record_seq > x.record_seq:
            x.record_seq, x.record = u.record_seq, u.record

    def _suspect(self, x: Member, u: Update, now: float) -> None:
        c = self.config
        first = not x.suspectors
        x.suspectors.add(u.issuer)
        k = min(len(x.suspectors) - 1, c.confirmations)
        frac = math.log(k + 1) / math.log(c.confirmations + 1)
        timeout = max(c.suspicion_min, c.suspicion_max - (c.suspicion_max - c.suspicion_min) * frac)
        start = now if first else x.since
        x.deadline = start + timeout
        # Confirmations come from members whose own probes fail: besides those the rounds
        # bring, a few members (about `confirmations` + 1 of those that probe it: the mesh,
        # or with `reachable` the member's neighbours) probe a newly suspected member at
        # once, so that a real failure reaches the shortest timeout without waiting on the
        # rounds' luck.
        if first and u.issuer != self.me and u.subject not in self.probing():
            near = self.reachable
            if near is None:
                probers = len(self._live)
            elif near(u.subject):
                probers = sum(1 for m in self._live if near(m))  # ours, for its neighbours'
            else:
                probers = 0  # not a neighbour: its neighbours probe it
            if probers and self.rng.random() < (c.confirmations + 1) / probers:
                self._later.append(self._start_probe(u.subject, now))

    def probing(self) -> set[str]:
        """The members a probe of this one is under way to."""
        return {p.target for p in self._probes.values()}

    # ----- piggybacking -----

    def _queue_update(self, u: Update, *, confirmation: bool = False) -> None:
        self._updates.put(u, confirmation=confirmation)

    def _piggyback(self) -> tuple[Update, ...]:
        return self._updates.take(self._n())

    def _send(self, out: Iterable[tuple[str, Message]]) -> Out:
        out = list(out)
        if self._later:
            out += self._later
            self._later = []
        self.bytes_sent += sum(m.size() for _, m in out)
        return out
