"""A simulated message bus for `meshagent/gossip/swim.py`: hundreds to thousands of members'
state machines under a virtual clock, one event queue, latencies from a table of inter-city
RTTs, loss, crashes and joins. No sockets and no encryption: the overlay's cost is modelled as
`FRAME_BYTES` per message on top of the message's encoded size (a Noise frame's tag and
length, the stream's header), so a thousand members run in minutes on one core.

With `signed`, members are what an agent runs but its streams: each has an ed25519 identity
and a signed record, its updates carry their issuers' proofs (`gossip/swim_proofs.py`, checked
by every receiver), and every message crosses the wire codec (`gossip/swim_wire.py`) as bytes,
whose length is what it costs. The members share their verdicts: an update's bytes get the
same verdict from every member, so each distinct one is verified once for the bus (an agent
verifies each once for itself), and every receiver still refuses a bad one and counts it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from nacl.signing import SigningKey

from meshagent.discovery.keep import KeepConfig, KeepSet
from meshagent.gossip import swim_wire
from meshagent.gossip.peer_record import ModelHeld, PeerRecord
from meshagent.gossip.signed import SignedRecord
from meshagent.gossip.swim import Message, State, Swim, SwimConfig
from meshagent.gossip.swim_proofs import SwimProofs
from meshagent.identity.keys import NodeIdentity
from meshagent.testing.city_rtts import CITIES, rtt

_KEEP_EVERY = 2.0  # seconds between a member's choices of its kept set
FRAME_BYTES = 40  # per message over the overlay: AEAD tag, lengths, stream header
MESH = "swim-bus-mesh"
_VERDICTS = 1 << 18  # verdicts the members share, most recent kept


class SwimBus:
    def __init__(
        self,
        *,
        seed: int = 0,
        loss: float = 0.0,
        cities: int = 3,
        config: SwimConfig | None = None,
        signed: bool = False,
        keep: KeepConfig | None = None,
    ) -> None:
        """`keep`: members connected as agents are on a bounded set (`discovery/keep.py`):
        each keeps a few members at random and the nearest by RTT, two members are connected
        when either keeps the other, and each probes (and gossips to) those it is connected
        to; a message to a member it is not connected to takes a dial first (1.5 RTT)."""
        self.signed = signed
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # shared (docstring)
        self.keep = keep
        self._keepers: dict[str, KeepSet] = {}
        self.kept: dict[str, set[str]] = {}  # each member's kept set, as last chosen
        self._kept_at: dict[str, float] = {}
        self._kept_size: dict[str, int] = {}
        self.identities: dict[str, NodeIdentity] = {}
        self.records: dict[str, PeerRecord] = {}  # each signed member's record as published
        self.rng = random.Random(seed)
        self.loss = loss
        self.config = config or SwimConfig()
        self.now = 0.0
        self.members: dict[str, Swim] = {}
        self.city: dict[str, str] = {}
        self.crashed: set[str] = set()
        self.wire_bytes: dict[str, int] = {}
        self._cities = self.rng.sample(CITIES, cities)
        self._rtts: dict[tuple[str, str], float] = {}
        self._events: list = []
        self._tie = itertools.count()
        self._scheduled: dict[str, float] = {}
        # each (observer, subject) whose state at the observer became DEAD, with when
        self.deaths: list[tuple[float, str, str]] = []
        # A partition: each member's side (members not listed are on side 0); a message
        # between sides is lost.
        self.side: dict[str, int] = {}
        self.on_dead: Callable[[float, str, str], None] | None = None

    # ----- the mesh -----

    def new_name(self) -> str:
        """A name for the next member: its peer id where members are signed."""
        if not self.signed:
            return f"m{len(self.members):04d}"
        identity = NodeIdentity(SigningKey(self.rng.randbytes(32)))  # a run repeats itself
        self.identities[identity.peer_id] = identity
        return identity.peer_id

    def add(self, name: str, contact: str | None = None) -> Swim:
        """A member; it joins through `contact` (none: the first of the mesh)."""
        seed = self.rng.getrandbits(32)
        if self.signed:
            identity = self.identities[name]
            proofs = SwimProofs(identity, MESH, verdicts=self._verdicts, remembered=_VERDICTS)
            m = Swim(
                name,
                config=self.config,
                seed=seed,
                now=self.now,
                incarnation=1_700_000_000_000 + int(self.now * 1000),
                sign=proofs.sign,
                verify=proofs.verify,
            )
            record = _record(identity, self.rng)
            self.records[name] = record.record
            m.publish(record.raw, self.now, record.seq)
        else:
            m = Swim(name, config=self.config, seed=seed, now=self.now)
        if self.keep is not None:
            self._keepers[name] = KeepSet(self.keep, random.Random(seed))
            self.kept[name] = set()
            self._kept_at[name] = -1.0
            m.reachable = lambda other, me=name: self.connected(me, other)
        self.members[name] = m
        self.city[name] = self.rng.choice(self._cities)
        self.wire_bytes[name] = 0
        if contact is not None:
            self._deliver(name, m.join(contact, self.now))
        self._reschedule(name)
        return m

    def grow(self, n: int, spacing: float = 0.01) -> list[str]:
        """n members, `spacing` seconds apart, each joining through a random earlier one."""
        names = [self.new_name()]
        self.add(names[0])
        for i in range(1, n):
            self.run_until(self.now + spacing)
            names.append(self.new_name())
            self.add(names[-1], contact=names[self.rng.randrange(i)])
        return names

    def republish(self, name: str, **fields: object) -> int:
        """A signed member publishes its record again with `fields` changed (its next
        version, which the others pull as they learn of it); the record's encoded size."""
        record = replace(self.records[name], seq=self.records[name].seq + 1, **fields)
        signed = SignedRecord.sign(record, self.identities[name], MESH)
        self.records[name] = record
        self.members[name].publish(signed.raw, self.now, record.seq)
        self._reschedule(name)
        return len(signed.raw)

    def crash(self, name: str) -> None:
        """It stops: sends nothing, and what is sent to it is lost."""
        self.crashed.add(name)

    def partition(self, away: set[str]) -> None:
        """`away` and the rest of the mesh stop hearing each other (`heal` ends it)."""
        self.side = dict.fromkeys(away, 1)

    def heal(self, spread: float = 2.0) -> None:
        """The partition ends: messages cross again, and within `spread` seconds each
        member's connections come back, each syncing with one member of the other side (a
        new connection is a digest sync in the agent, `SwimService._joins`)."""
        sides = self.side
        self.side = {}
        running = sorted(k for k in self.members if k not in self.crashed)
        near = [k for k in running if sides.get(k, 0) == 0]
        away = [k for k in running if sides.get(k, 0) == 1]
        if not near or not away:
            return
        for k in running:
            other = away if sides.get(k, 0) == 0 else near
            when = self.now + self.rng.uniform(0.0, spread)
            heapq.heappush(
                self._events, (when, next(self._tie), "sync", k, self.rng.choice(other), None)
            )

    def connected(self, a: str, b: str) -> bool:
        """Whether `a` and `b` hold a connection: either keeps the other."""
        return b in self.kept.get(a, ()) or a in self.kept.get(b, ())

    def _choose_kept(self, name: str) -> None:
        """`name` chooses its kept set again, as it ticks: every `_KEEP_EVERY` seconds, and
        whenever its view has grown or shrunk by a tenth (as an agent's dialer reviews its
        set at every probe)."""
        m = self.members[name]
        size = len(m.alive_others())
        was = self._kept_size.get(name, 0)
        if self.now - self._kept_at[name] < _KEEP_EVERY and abs(size - was) < max(2, was / 10):
            return
        self._kept_at[name] = self.now
        self._kept_size[name] = size
        self.kept[name] = self._keepers[name].choose(
            m.alive_others(), lambda other: self.rtt_ms(name, other), m.probing()
        )

    def rtt_ms(self, a: str, b: str) -> float:
        """The round trip between two members (ms), as their messages take it."""
        return 2000.0 * self._latency_base(a, b)

    def _latency_base(self, a: str, b: str) -> float:
        key = (a, b) if a < b else (b, a)
        ms = self._rtts.get(key)
        if ms is None:
            ms = self._rtts[key] = rtt(self.city[a], self.city[b], self.rng)
        return ms / 2000.0

    def _latency(self, a: str, b: str) -> float:
        return self._latency_base(a, b) * self.rng.uniform(1.0, 1.1)  # one way, seconds

    # ----- running -----

    def run_until(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            when, _, kind, a, b, msg = heapq.heappop(self._events)
            self.now = when
            if kind == "sync":  # a connection back after a partition: a digest sync
                if a not in self.crashed:
                    self._deliver(a, self.members[a].sync_with(b))
                    self._reschedule(a)
                continue
            if kind == "tick":
                if a in self.crashed or self._scheduled.get(a) != when:
                    continue
                del self._scheduled[a]
                if self.keep is not None:
                    self._choose_kept(a)
                self._deliver(a, self.members[a].tick(when))
                self._note_deaths(a)
                self._reschedule(a)
            else:  # a message from b to a
                if a in self.crashed or a not in self.members:
                    continue
                if self.side and self.side.get(a, 0) != self.side.get(b, 0):
                    continue  # in flight when the partition began
                if self.signed:
                    msg = swim_wire.decode(msg)
                self._deliver(a, self.members[a].receive(when, b, msg))
                self._note_deaths(a)
                self._reschedule(a)
        self.now = t

    def _note_deaths(self, observer: str) -> None:
        died = self.members[observer].died
        if died:
            self.deaths.extend((when, observer, m) for when, m in died)
            died.clear()

    def _reschedule(self, name: str) -> None:
        if name in self.crashed:
            return
        when = max(self.members[name].next_timer(), self.now + 1e-6)
        if self._scheduled.get(name) != when:
            self._scheduled[name] = when
            heapq.heappush(self._events, (when, next(self._tie), "tick", name, "", None))

    def _deliver(self, source: str, out: list[tuple[str, Message]]) -> None:
        for dest, msg in out:
            if self.signed:  # the message as bytes: what it costs, and what arrives
                msg = swim_wire.encode(msg)
                self.wire_bytes[source] += len(msg) + FRAME_BYTES
            else:
                self.wire_bytes[source] += msg.size() + FRAME_BYTES
            if dest in self.crashed or self.rng.random() < self.loss:
                continue
            if self.side and self.side.get(dest, 0) != self.side.get(source, 0):
                continue
            when = self.now + self._latency(source, dest)
            if self.keep is not None and not self.connected(source, dest):
                when += 3 * self._latency_base(source, dest)  # a dial first: 1.5 RTT
            heapq.heappush(self._events, (when, next(self._tie), "msg", dest, source, msg))

    # ----- what the members see -----

    def views_complete(self, names: set[str]) -> bool:
        """Every running member of `names` lists exactly `names` as alive or suspect."""
        running = [self.members[n] for n in names if n not in self.crashed]
        if any(len(m.alive_others()) != len(names) - 1 for m in running):
            return False  # (counted first: comparing sets of a thousand is the slow part)
        return all(m.alive() == names for m in running)

    def quiet(self) -> bool:
        """No running member has updates left to spread."""
        return all(not m.pending_updates for k, m in self.members.items() if k not in self.crashed)

    def dead_everywhere(self, name: str) -> bool:
        """Every running member other than `name` knows it dead."""
        return all(
            m.state_of(name) == State.DEAD
            for k, m in self.members.items()
            if k != name and k not in self.crashed
        )


def _record(identity: NodeIdentity, rng: random.Random) -> SignedRecord:
    """A record of an agent's usual size: its name, addresses, memory, speed and a model."""
    record = PeerRecord(
        identity.peer_id,
        identity.public_key,
        seq=1,
        name=f"agent-{identity.peer_id[:6]}",
        addresses=(f"198.51.100.{rng.randrange(1, 255)}:9338",),
        mem_weights_bytes=rng.randrange(4, 64) * 10**9,
        mem_kv_bytes=rng.randrange(1, 16) * 10**9,
        compute_speed=round(rng.uniform(50, 2000), 1),
        compute_unit="matmul_gflops_f32",
        models=(ModelHeld("Llama-3.1-70B-Q4_K_M", "ab" * 32, "llama", 80, 42_500_000_000),),
    )
    return SignedRecord.sign(record, identity, MESH)
