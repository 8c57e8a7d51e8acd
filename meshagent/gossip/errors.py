"""Errors of the gossip layer."""

from __future__ import annotations

from meshagent.errors import MeshError


class GossipError(MeshError):
    """Gossip could not do what was asked; the message says why."""


class RecordRejected(GossipError):
    """A gossiped item (record, heartbeat, obituary) is malformed, forged or too large.

    Raised at decode, so nothing unverified enters the membership table."""


class ExchangeError(GossipError):
    """A push-pull exchange broke a protocol rule; the exchange is abandoned."""
