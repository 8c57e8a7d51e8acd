"""Which peers an agent keeps connections to when its membership does not need them all
(membership by probes, `gossip/swim_service.py`), sans-IO.

With the heartbeat protocol every agent gossips with every other, so the dialer keeps a
connection to every member. Membership by probes needs far fewer: the members it is about to
probe (dialled `lookahead` probes ahead, so the PING finds a connection), a few members drawn
at random (kept while they live: they carry its gossip, and make the connection graph one
that spreads), a few of the nearest by estimated RTT (so that network coordinates measure
near peers as well as far ones), and whatever the caller pins (peers a probe is under way
to, relays). Every other connection this agent opened is closed once it has carried nothing
but membership for `idle_close` seconds; a connection another agent opened is that agent's
to close. Streams to a peer without a connection dial it first (`ConnectionManager.reach`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepConfig:
    random: int = 4  # members kept at random, drawn again as they die
    near: int = 4  # the members nearest by estimated RTT
    lookahead: int = 3  # the next members of the probe order, dialled before their probe
    idle_close: float = 1.0  # seconds an unkept connection we opened may idle before it closes


class KeepSet:
    """The peers to keep connected, chosen again at every review."""

    def __init__(self, config: KeepConfig | None = None, rng: random.Random | None = None):
        self.config = config or KeepConfig()
        self._rng = rng or random.Random()
        self._random: list[str] = []

    def choose(
        self,
        members: Sequence[str],
        estimate_ms: Callable[[str], float | None],
        pinned: Iterable[str] = (),
    ) -> set[str]:
        """Of `members` (the others alive), the random and the nearest ones (`estimate_ms`:
        a member's estimated RTT, None where unknown), with `pinned` whatever they are."""
        alive = set(members)
        self._random = [m for m in self._random if m in alive]
        if len(self._random) < self.config.random:
            pool = sorted(alive.difference(self._random))
            draw = min(self.config.random - len(self._random), len(pool))
            self._random += self._rng.sample(pool, draw)
        known = [(ms, m) for m in members if (ms := estimate_ms(m)) is not None]
        near = [m for _, m in sorted(known)[: self.config.near]]
        return {*self._random, *near, *pinned}


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
