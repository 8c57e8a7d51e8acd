"""Tunables of the overlay, with defaults that suit a LAN or WAN mesh."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshagent.net.backoff import Backoff


@dataclass(frozen=True)
class OverlayConfig:
    """Seconds unless noted. There is deliberately no idle or credit timeout: a peer whose
    application is busy (a stage computing for a minute) is never cut off. Only a peer that
    stops answering PINGs at the transport level for `dead_peer_timeout` is dropped. One that
    has not answered for `silent_after` (or 8 round trips, if longer) is reported to the
    overlay's `on_silent` (the dialer then finds out whether it is gone, or only its path)."""

    handshake_timeout: float = 10.0
    max_pending_handshakes: int = 256  # inbound handshakes in progress at once, per listener
    # Authenticated connections peers opened to us, all peers together (a member can make
    # identities at will: each one's connection counts here), and from one peer id: its
    # active connection and one being replaced (drained). Past either, a new inbound
    # connection is refused with BYE(REFUSED) and a logged reason; dialing out is not limited.
    max_inbound_connections: int = 128
    max_connections_per_peer: int = 2
    drain_grace: float = 5.0
    ping_interval: float = 0.5
    silent_after: float | None = 1.25
    dead_peer_timeout: float | None = 60.0
    close_flush_timeout: float = 5.0  # how long a closing connection waits to send its BYE
    read_size: int = 256 * 1024  # bytes asked of the transport per receive
    write_batch: int = 256 << 10  # bytes of frames sealed into one transport write
    max_control_backlog: int = 1 << 20  # the reader pauses while this much control is queued
    dial_backoff: Backoff = field(default_factory=Backoff)
