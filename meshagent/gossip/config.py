"""Gossip tunables. Seconds unless noted."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.errors import ConfigError
from meshagent.gossip.merge import BEAT_LEAD_MS

# An obituary is dated up to `suspect_after` plus the silence before it past its subject's
# last beat; the timers stay well inside the lead an obituary may have (merge.BEAT_LEAD_MS).
_MAX_TIMERS_S = BEAT_LEAD_MS / 1000 / 2


@dataclass(frozen=True)
class GossipConfig:
    """`interval` is both the heartbeat period and the period of push-pull rounds (each
    round: one exchange with one random connected peer). A peer whose heartbeat has not
    advanced for `suspect_after` is suspect, for `dead_after` dead (and announced dead).
    The defaults tolerate the propagation delay of heartbeats in a 30-peer mesh (see
    docs/gossip.md) and detect a dead peer in at most dead_after + interval."""

    interval: float = 1.0
    fanout: int = 2  # exchanges this node starts per interval
    suspect_after: float = 4.5
    dead_after: float = 8.0
    forget_after: float = 3600.0  # a dead peer's items are dropped this long after its death
    exchange_timeout: float = 5.0
    max_message: int = 2 << 20  # bytes of one gossip message
    inbound_burst: int = 8  # exchanges a peer may start with us back to back...
    inbound_rate: float = 4.0  # ...then this many per second
    rtt_refresh: float = 10.0  # our record's RTT figures are republished at most this often
    max_members: int = 1024

    def validate(self) -> None:
        if self.interval <= 0:
            raise ConfigError("gossip interval must be > 0 seconds")
        if not self.interval < self.suspect_after < self.dead_after:
            raise ConfigError(
                "gossip timers must satisfy interval < suspect_after < dead_after "
                f"(got {self.interval}, {self.suspect_after}, {self.dead_after})"
            )
        total = self.interval + self.suspect_after + self.dead_after
        if total > _MAX_TIMERS_S:
            raise ConfigError(
                "gossip timers interval + suspect_after + dead_after must stay within "
                f"{_MAX_TIMERS_S:g} s (got {total:g})"
            )
