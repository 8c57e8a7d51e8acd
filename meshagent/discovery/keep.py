"""Which peers an agent keeps connections to when its membership does not need them all
(membership by probes, `gossip/swim_service.py`), sans-IO.

With the heartbeat protocol every agent gossips with every other, so the dialer keeps a
connection to every member. Membership by probes needs far fewer: each agent keeps a few
members drawn at random (kept while they live: the connection graph is then one that spreads
gossip and holds together), a few of the nearest by estimated RTT among a sample of the mesh
(so that network coordinates measure near peers as well as far ones), and whatever the caller
pins (a probe under way). Each agent probes its neighbours: the members it keeps and those
that opened a connection to it (which they keep, or close soon), so every member is watched
by at least the few it keeps itself and by those that keep it; a connection it opened and
does not keep (a join, one dialled for a stream or a PING-REQ) carries no probe, and is
closed once membership has said nothing on it for `idle_close` seconds and no other
service's stream is open on it; a connection another agent opened is that agent's to close.
Streams to a peer without a connection dial it first (`ConnectionManager.reach`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

_POOL = 8  # the nearest are looked for among this many members per one kept


@dataclass(frozen=True)
class KeepConfig:
    random: int = 4  # members kept at random, drawn again as they die
    near: int = 4  # the members nearest by estimated RTT
    idle_close: float = 1.0  # seconds an unkept connection we opened may idle before it closes


class KeepSet:
    """The peers to keep connected, chosen again at every review."""

    def __init__(self, config: KeepConfig | None = None, rng: random.Random | None = None):
        self.config = config or KeepConfig()
        self._rng = rng or random.Random()
        self._random: list[str] = []
        self._seen: set[str] = set()  # every member seen, for the random picks' sampling
        self._near: list[str] = []
        self._pool: list[str] = []  # the members the nearest are looked for among
        self._jitter: dict[str, float] = {}
        self._lasting: frozenset[str] = frozenset()

    def choose(
        self,
        members: Sequence[str],
        estimate_ms: Callable[[str], float | None],
        pinned: Iterable[str] = (),
    ) -> set[str]:
        """Of `members` (the others alive), the random and the nearest ones (`estimate_ms`:
        a member's estimated RTT, None where unknown), with `pinned` whatever they are."""
        alive = set(members)
        k = self.config.random
        # A uniform sample of the members seen (reservoir sampling: the i-th member seen
        # takes a pick's place with chance k / i), so that the picks made while this agent
        # knew few members (its contact at first) do not stay: kept while they live, else.
        for m in sorted(alive - self._seen):
            self._seen.add(m)
            if len(self._random) < k:
                self._random.append(m)
            elif self._rng.random() < k / len(self._seen):
                self._random[self._rng.randrange(k)] = m
        self._random = [m for m in self._random if m in alive]
        if len(self._random) < k:
            pool = sorted(alive.difference(self._random))
            draw = min(k - len(self._random), len(pool))
            self._random += self._rng.sample(pool, draw)
        # The nearest of a sample of the mesh (drawn again as its members die), not of all:
        # where RTTs are alike, every agent's nearest would be the same few.
        self._pool = [m for m in self._pool if m in alive]
        self._jitter = {m: f for m, f in self._jitter.items() if m in alive}
        want = min(len(alive), _POOL * self.config.near)
        if len(self._pool) < want:
            rest = sorted(alive.difference(self._pool))
            self._pool += self._rng.sample(rest, want - len(self._pool))
        # Each estimate scaled by a factor of this agent's own (1-1.25) per member, so that
        # of members about as near, agents pick different ones.
        for m in self._pool:
            self._jitter.setdefault(m, self._rng.uniform(1.0, 1.25))
        known = [
            (ms * self._jitter[m], m) for m in self._pool if (ms := estimate_ms(m)) is not None
        ]
        self._near = [m for _, m in sorted(known)[: self.config.near]]
        self._lasting = frozenset((*self._random, *self._near))
        return {*self._lasting, *pinned}

    def lasting(self) -> frozenset[str]:
        """The members kept for more than a probe: the random and the nearest ones."""
        return self._lasting


class IdleConnections:
    """When each closable connection (one this agent opened, carrying no stream but
    membership's) outside the kept set became so, and which have been so `idle_close`."""

    def __init__(self, idle_close: float) -> None:
        self.idle_close = idle_close
        self._since: dict[str, float] = {}

    def to_close(self, now: float, closable: Iterable[str], kept: set[str]) -> list[str]:
        """The peers whose connection to close now (`closable`: the peers whose connection
        could be closed, as above)."""
        idle = set(closable) - kept
        self._since = {p: self._since.get(p, now) for p in idle}
        return sorted(p for p, since in self._since.items() if now - since >= self.idle_close)
