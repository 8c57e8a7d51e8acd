"""The membership table, sans-IO: what this node knows of every peer, how it merges what
others send, and when it declares a peer suspect or dead.

No clocks, sockets or tasks here: callers pass `now` (a monotonic time, seconds) and
`wall_time` (the wall clock, for owner-side sequence numbers and beats; between two beats the
table reads it as the last one advanced by `now`), and a `Heard` function says when this node
last heard a peer directly (hearsay.py: what it hears itself beats hearsay). Everything is
plain method calls, so the protocol's rules are tested with tables (tests/gossip/).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from meshagent.gossip import merge
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.errors import RecordRejected
from meshagent.gossip.failure import PeerState, classify
from meshagent.gossip.hearsay import Heard, hears, introductions
from meshagent.gossip.merge import Verdict
from meshagent.gossip.messages import DigestEntry, Items
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.signed import MAX_BEAT, Heartbeat, Obituary, SignedRecord, sign_new_record
from meshagent.identity.keys import NodeIdentity

log = structlog.get_logger(__name__)

# Bytes of a DELTA message that are not items (CBOR map, the wants list's framing).
_DELTA_OVERHEAD = 64
_MAX_SEQ = (1 << 64) - 1


@dataclass
class Entry:
    """What is known of one peer. `last_progress` is the local time its heartbeat last
    advanced (or it was first heard of)."""

    peer_id: str
    first_seen: float
    last_progress: float
    record: SignedRecord | None = None
    heartbeat: Heartbeat | None = None
    obituary: Obituary | None = None
    state: PeerState = PeerState.ALIVE
    state_since: float = 0.0
    disputed: tuple[str, int] | None = None  # (issuer, beat) of the last obituary disputed

    @property
    def beat(self) -> int:
        return self.heartbeat.beat if self.heartbeat is not None else 0

    @property
    def seq(self) -> int:
        return self.record.seq if self.record is not None else 0

    def beat_clock(self, now: float) -> int | None:
        """Where this peer's beats can have got to by `now` (None: no heartbeat of it)."""
        if self.heartbeat is None:
            return None
        return merge.beat_clock(self.heartbeat.beat, now - self.last_progress)

    def digest_entry(self) -> DigestEntry:
        obit = self.obituary.beat if self.obituary is not None else 0
        return DigestEntry(self.peer_id, self.seq, max(self.beat, obit), self.obituary is not None)


@dataclass(frozen=True)
class Change:
    """Something placement may care about: a peer `joined` (its first record), its `record`
    changed, its `state` changed, or it was `forgotten` (dead for `forget_after`, or dropped
    from a full table to make room for a peer this node hears)."""

    peer_id: str
    kind: str
    state: PeerState


@dataclass(frozen=True)
class PeerView:
    """One peer as the snapshot API shows it."""

    peer_id: str
    record: PeerRecord
    state: PeerState
    silent_s: float  # seconds since its heartbeat last advanced here
    beat: int


@dataclass
class _Delta:
    """One call of `apply`: where its items came from, what changed, what was rejected (and
    why), the (kind, peer) pairs seen so far, and the new members refused (by reason)."""

    source: str
    changes: list[Change] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    seen: set[tuple[str, str]] = field(default_factory=set)
    refused: Counter = field(default_factory=Counter)


@dataclass
class Stats:
    accepted: Counter = field(default_factory=Counter)  # by item kind
    stale: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    disputed: int = 0  # obituaries about peers heard directly, not taken
    evicted: int = 0  # members dropped from a full table for one heard directly


class GossipState:
    """The table of one node. Its own entry is always alive and only it signs its items.
    `heard` says when this node last heard a peer directly (None: it hears nobody)."""

    def __init__(
        self,
        identity: NodeIdentity,
        mesh: str,
        config: GossipConfig,
        *,
        now: float,
        heard: Heard | None = None,
    ) -> None:
        config.validate()
        self.identity = identity
        self.self_id = identity.peer_id
        self.mesh = mesh
        self.config = config
        self.entries: dict[str, Entry] = {self.self_id: Entry(self.self_id, now, now)}
        self.stats = Stats()
        self.heard = heard
        self._introductions = introductions()
        self._fields: dict[str, Any] = {}
        self._wall = 0.0
        self._wall_at: float | None = None  # `now` of the beat that last read the wall clock
        self.leaving = False

    @property
    def me(self) -> Entry:
        return self.entries[self.self_id]

    # ----- the owner's side -----

    def publish(self, *, wall_time: float, min_seq: int = 0, **fields: Any) -> SignedRecord:
        """Issue (and sign) a new record of ours with `fields` changed; returns it."""
        candidate = {**self._fields, **fields}
        self._wall = max(self._wall, wall_time)
        seq = max(int(self._wall * 1_000_000), self.me.seq + 1, min_seq)
        signed = sign_new_record(self.identity, self.mesh, candidate, seq=seq, wall_time=wall_time)
        self._fields = candidate
        self.me.record = signed
        return signed

    def beat(self, *, now: float, wall_time: float, min_beat: int = 0) -> Heartbeat:
        """Issue our next heartbeat: wall-clock milliseconds, kept strictly increasing (up to
        `MAX_BEAT`)."""
        self._wall = max(self._wall, wall_time)
        self._wall_at = now
        value = min(max(int(self._wall * 1000), self.me.beat + 1, min_beat), MAX_BEAT)
        me = self.me
        me.heartbeat = Heartbeat.sign(self.identity, value, self.mesh)
        me.last_progress = now
        return me.heartbeat

    def leave(self) -> Obituary:
        """Announce that we are leaving: an obituary for ourselves at our latest beat, which
        others take at once (instead of waiting out `dead_after`). A restart outgrows it."""
        me = self.me
        me.obituary = Obituary.sign(self.identity, self.self_id, me.beat, self.mesh)
        self.leaving = True
        return me.obituary

    # ----- anti-entropy -----

    def digest(self) -> list[DigestEntry]:
        return [e.digest_entry() for e in self.entries.values()]

    def wants_from(self, theirs: Iterable[DigestEntry]) -> list[DigestEntry]:
        """Our entries (zeros when unknown) for the peers the other side knows more about."""
        out = []
        for t in theirs:
            mine = self.entries.get(t.peer_id)
            entry = mine.digest_entry() if mine is not None else None
            if merge.wants(entry, t):
                out.append(entry or DigestEntry(t.peer_id))
        return out

    def items_for(
        self, theirs: Iterable[DigestEntry], *, complete: bool, budget: int, now: float
    ) -> Items:
        """The items the other side lacks, given its digest. `complete`: `theirs` lists
        everything it knows (peers absent from it are unknown to it); otherwise only the
        listed peers are considered. At most `budget` bytes of items: obituaries and
        heartbeats first (they are small and carry liveness), then records; of each kind,
        ours and those of the peers we hear directly first (a joining agent learns the
        members that are surely real before the ones only heard of)."""
        known = {t.peer_id: t for t in theirs}
        peers = sorted(
            (
                self.entries.values()
                if complete
                else (self.entries[p] for p in known if p in self.entries)
            ),
            key=lambda e: e.peer_id != self.self_id and not self._hears(e.peer_id, now),
        )
        obits: list[bytes] = []
        beats: list[bytes] = []
        records: list[bytes] = []
        for e in peers:
            send_record, send_beat, send_obit = merge.to_send(
                e.digest_entry(), e.beat, known.get(e.peer_id)
            )
            if send_obit and e.obituary is not None:
                obits.append(e.obituary.to_cbor())
            if send_beat and e.heartbeat is not None:
                beats.append(e.heartbeat.to_cbor())
            if send_record and e.record is not None:
                records.append(e.record.raw)
        room = budget - _DELTA_OVERHEAD
        chosen: dict[str, list[bytes]] = {"obits": [], "beats": [], "records": []}
        for kind, items in (("obits", obits), ("beats", beats), ("records", records)):
            for item in items:
                cost = len(item) + 5
                if cost <= room:
                    chosen[kind].append(item)
                    room -= cost
        return Items(tuple(chosen["records"]), tuple(chosen["beats"]), tuple(chosen["obits"]))

    def apply(self, items: Items, *, now: float, source: str = "?") -> list[Change]:
        """Merge items received from `source`; forged, malformed, stale and duplicate items
        (a second of one kind for one peer) are counted and ignored, the rejected ones logged
        once per call. Returns what changed."""
        delta = _Delta(source)
        for raw in items.records:
            self._apply_record(raw, now, delta)
        for raw in items.beats:
            self._apply_beat(raw, now, delta)
        for raw in items.obituaries:
            self._apply_obituary(raw, now, delta)
        if delta.rejected:
            kind, reason = delta.rejected[0]
            counts = dict(Counter(k for k, _ in delta.rejected))
            log.warning(
                "gossip.item_rejected", source=source, kind=kind, reason=reason, counts=counts
            )
        if delta.refused:
            log.warning(
                "gossip.members_refused",
                source=source,
                limit=self.config.max_members,
                **dict(delta.refused),
            )
        return delta.changes

    # ----- failure detection -----

    def tick(self, *, now: float) -> list[Change]:
        """Re-classify every peer; declare (and sign an obituary for) peers silent for
        `dead_after`; forget peers dead for `forget_after`."""
        changes: list[Change] = []
        for e in list(self.entries.values()):
            if e.peer_id == self.self_id:
                continue
            state = classify(
                now, e.last_progress, announced_dead=e.obituary is not None, config=self.config
            )
            if state is PeerState.DEAD and e.obituary is None:
                e.obituary = Obituary.sign(self.identity, e.peer_id, e.beat, self.mesh)
                log.info(
                    "gossip.peer_dead",
                    peer=e.peer_id,
                    silent_s=round(now - e.last_progress, 2),
                    announced_by="us",
                )
            self._set_state(e, state, now, changes)
            if e.state is PeerState.DEAD and now - e.state_since >= self.config.forget_after:
                del self.entries[e.peer_id]
                changes.append(Change(e.peer_id, "forgotten", PeerState.DEAD))
        return changes

    def declare_dead(self, peer_id: str, *, now: float, reason: str) -> list[Change]:
        """`peer_id` is gone for certain (say, nothing listens where its process did): sign
        its obituary now instead of waiting out `dead_after`. A peer that is in fact alive
        refutes it (it outgrows the obituary's beat when it hears of it). Returns what changed.

        The obituary's beat covers the heartbeats the peer may have sent before it died that
        have not reached us yet (a wall-clock ms beat sent at most `suspect_after` before it
        arrived here, by the gossip timers' own bound): signed at the last beat seen, such a
        heartbeat arriving late by way of another peer would bring the dead peer back."""
        e = self.entries.get(peer_id)
        if e is None or peer_id == self.self_id or e.obituary is not None:
            return []
        unseen_s = max(0.0, now - e.last_progress) + self.config.suspect_after
        beat = min(merge.beat_clock(e.beat, unseen_s), MAX_BEAT)
        e.obituary = Obituary.sign(self.identity, peer_id, beat, self.mesh)
        log.info("gossip.peer_dead", peer=peer_id, reason=reason, announced_by="us")
        changes: list[Change] = []
        self._set_state(e, PeerState.DEAD, now, changes)
        return changes

    # ----- queries -----

    def views(self, *, now: float, include_dead: bool = False) -> dict[str, PeerView]:
        out = {}
        for e in self.entries.values():
            if e.record is None or (e.state is PeerState.DEAD and not include_dead):
                continue
            out[e.peer_id] = PeerView(
                e.peer_id, e.record.record, e.state, max(0.0, now - e.last_progress), e.beat
            )
        return out

    # ----- internals -----

    def _hears(self, peer_id: str, now: float) -> bool:
        return hears(self.heard, peer_id, now)

    def _entry(self, peer_id: str, now: float, kind: str, delta: _Delta) -> Entry | None:
        """The entry of `peer_id`, made if new and there is room (hearsay.py: a member heard
        directly gets room in a full table; a peer introduces others within a budget)."""
        e = self.entries.get(peer_id)
        if e is not None:
            return e
        direct = self._hears(peer_id, now)
        hearsay = not direct and peer_id != delta.source
        reason = None
        if len(self.entries) >= self.config.max_members:
            if not (direct and self._make_room(peer_id, now, delta)):
                reason = "member_limit"
        elif hearsay and not self._introductions.take(delta.source, now):
            reason = "introductions"
        if reason is not None:
            self.stats.rejected[f"{kind}:{reason}"] += 1
            delta.refused[reason] += 1
            return None
        e = self.entries[peer_id] = Entry(peer_id, now, now, state_since=now)
        return e

    def _make_room(self, newcomer: str, now: float, delta: _Delta) -> bool:
        """Drop, for `newcomer`, the member we do not hear whose heartbeat advanced least
        recently (made-up members, dead ones); False when we hear every member."""
        heard_of = [
            e
            for e in self.entries.values()
            if e.peer_id != self.self_id and not self._hears(e.peer_id, now)
        ]
        if not heard_of:
            return False
        e = min(heard_of, key=lambda e: e.last_progress)
        del self.entries[e.peer_id]
        self.stats.evicted += 1
        delta.changes.append(Change(e.peer_id, "forgotten", e.state))
        log.info(
            "gossip.member_evicted",
            peer=e.peer_id,
            silent_s=round(now - e.last_progress, 2),
            room_for=newcomer,
        )
        return True

    def _wall_now(self, now: float) -> float:
        """Our wall clock at `now`: the last beat's reading, advanced by `now`."""
        return self._wall + (max(0.0, now - self._wall_at) if self._wall_at is not None else 0)

    def _wall_ms(self, now: float) -> int | None:
        """Our wall clock at `now` in ms (None before our first beat)."""
        return None if self._wall_at is None else int(self._wall_now(now) * 1000)

    def _reject(self, kind: str, reason: str, delta: _Delta) -> None:
        self.stats.rejected[kind] += 1
        delta.rejected.append((kind, reason))

    def _first(self, kind: str, peer_id: str, delta: _Delta) -> bool:
        """Whether this is the first item of `kind` for `peer_id` in one delta: an honest one
        carries at most one, and a second must not cost a second check of its signature."""
        if (kind, peer_id) in delta.seen:
            self._reject(kind, f"a second {kind} for {peer_id} in one delta", delta)
            return False
        delta.seen.add((kind, peer_id))
        return True

    def _apply_record(self, raw: bytes, now: float, delta: _Delta) -> None:
        try:
            signed = SignedRecord.from_cbor(raw, self.mesh)
        except RecordRejected as e:
            self._reject("record", str(e), delta)
            return
        pid = signed.peer_id
        if not self._first("record", pid, delta):
            return
        if pid == self.self_id:
            if self.me.seq < signed.seq < _MAX_SEQ:  # a record of ours from before a restart
                self.publish(wall_time=self._wall, min_seq=signed.seq + 1)
            self.stats.stale["record"] += 1
            return
        known = self.entries.get(pid)
        verdict = merge.record_verdict(
            known.seq if known is not None and known.record is not None else None, signed.seq
        )
        if verdict is Verdict.STALE:
            self.stats.stale["record"] += 1
            return
        e = self._entry(pid, now, "record", delta)
        if e is None:
            return
        self.stats.accepted["record"] += 1
        e.record = signed
        kind = "joined" if verdict is Verdict.NEW else "record"
        if kind == "joined":
            log.info("gossip.peer_joined", peer=pid, name=signed.record.name, source=delta.source)
        delta.changes.append(Change(pid, kind, e.state))

    def _apply_beat(self, raw: bytes, now: float, delta: _Delta) -> None:
        try:
            hb = Heartbeat.decode(raw)
        except RecordRejected as e:
            self._reject("heartbeat", str(e), delta)
            return
        pid = hb.peer_id
        if not self._first("heartbeat", pid, delta):
            return
        known = self.entries.get(pid)
        known_beat = known.beat if known is not None and known.heartbeat is not None else None
        if merge.beat_verdict(known_beat, hb.beat) is Verdict.STALE:
            self.stats.stale["heartbeat"] += 1
            return
        try:
            hb.verify(self.mesh)
        except RecordRejected as e:
            self._reject("heartbeat", str(e), delta)
            return
        if pid == self.self_id:  # a beat of ours from before a restart: outgrow it
            self.beat(now=now, wall_time=self._wall_now(now), min_beat=hb.beat + 1)
            return
        e = self._entry(pid, now, "heartbeat", delta)
        if e is None:
            return
        self.stats.accepted["heartbeat"] += 1
        e.heartbeat = hb
        e.last_progress = now
        if e.obituary is not None and not merge.obituary_survives(e.obituary.beat, hb.beat):
            e.obituary = None
            log.info("gossip.peer_back", peer=pid, source=delta.source)
        self._set_state(e, PeerState.ALIVE if e.obituary is None else e.state, now, delta.changes)

    def _apply_obituary(self, raw: bytes, now: float, delta: _Delta) -> None:
        try:
            obit = Obituary.decode(raw)
        except RecordRejected as e:
            self._reject("obituary", str(e), delta)
            return
        pid = obit.subject
        if not self._first("obituary", pid, delta):
            return
        e = self.entries.get(pid)
        if e is None:  # nothing to declare dead here (and no room taken for a stranger)
            self.stats.stale["obituary"] += 1
            return
        verdict = merge.obituary_verdict(
            e.beat if e.heartbeat is not None else None,
            e.obituary.beat if e.obituary is not None else None,
            obit.beat,
        )
        if verdict is Verdict.STALE or (pid == self.self_id and self.leaving):
            self.stats.stale["obituary"] += 1
            return
        wall = self._wall_ms(now)
        if wall is None:  # before our first beat: too early to judge a date (it comes again)
            self.stats.stale["obituary"] += 1
            return
        if pid == self.self_id:
            ceiling = merge.refute_ceiling(wall)
        else:
            ceiling = merge.obituary_ceiling(wall, e.beat_clock(now))
        if obit.beat > ceiling:
            past = (obit.beat - ceiling) / 1000
            reason = f"an obituary for {pid} dated {past:.0f} s past the latest it may carry"
            self._reject("obituary", reason, delta)
            return
        try:
            obit.verify(self.mesh)
        except RecordRejected as err:
            self._reject("obituary", str(err), delta)
            return
        if pid == self.self_id:  # we are said to be dead: refute with a newer heartbeat
            log.info("gossip.refuted_obituary", reporter=obit.reporter, source=delta.source)
            self.beat(now=now, wall_time=self._wall_now(now), min_beat=obit.beat + 1)
            return
        if obit.reporter != pid and self._hears(pid, now):
            self._dispute(e, obit, delta)
            return
        self.stats.accepted["obituary"] += 1
        e.obituary = obit
        if e.state is not PeerState.DEAD:
            log.info("gossip.peer_dead", peer=pid, announced_by=obit.reporter, source=delta.source)
        self._set_state(e, PeerState.DEAD, now, delta.changes)

    def _dispute(self, e: Entry, obit: Obituary, delta: _Delta) -> None:
        """Another peer says `e` is dead while we hear it: it stays alive here, and we do not
        pass the obituary on. Logged once per obituary (peers push it while digests differ)."""
        self.stats.disputed += 1
        if e.disputed != (obit.reporter, obit.beat):
            e.disputed = (obit.reporter, obit.beat)
            log.warning(
                "gossip.obituary_disputed",
                issuer=obit.reporter,
                subject=e.peer_id,
                source=delta.source,
            )

    def _set_state(self, e: Entry, state: PeerState, now: float, changes: list[Change]) -> None:
        if state is e.state:
            return
        if state is PeerState.SUSPECT:
            log.info(
                "gossip.peer_suspect", peer=e.peer_id, silent_s=round(now - e.last_progress, 2)
            )
        e.state = state
        e.state_since = now
        changes.append(Change(e.peer_id, "state", state))
