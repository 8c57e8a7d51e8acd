"""Failure detection: alive, suspect or dead, from how long a heartbeat has not advanced."""

from __future__ import annotations

from enum import StrEnum

from meshagent.gossip.config import GossipConfig


class PeerState(StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"  # no heartbeat progress for suspect_after: still routed to, warned
    DEAD = "dead"  # no progress for dead_after, or announced dead: not routed to


def classify(now: float, last_progress: float, *, announced_dead: bool, config: GossipConfig):
    """The state of a peer whose heartbeat last advanced (as seen here) at `last_progress`."""
    if announced_dead:
        return PeerState.DEAD
    silent = now - last_progress
    if silent >= config.dead_after:
        return PeerState.DEAD
    if silent >= config.suspect_after:
        return PeerState.SUSPECT
    return PeerState.ALIVE
