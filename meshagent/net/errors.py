"""Errors the overlay raises to applications."""

from __future__ import annotations

import trio

from meshagent.errors import MeshError
from meshagent.wire.errors import ErrorCode, HandshakeError


class StreamResetError(MeshError, trio.BrokenResourceError):
    """The stream was aborted: by the peer, by us after a peer's violation, or because its
    connection ended. `reason` says which; nothing is dropped without this error."""

    def __init__(self, stream_id: int, code: ErrorCode, reason: str, *, by_peer: bool) -> None:
        who = "peer" if by_peer else "local side"
        super().__init__(f"stream {stream_id} reset by {who} ({code.name}): {reason}")
        self.stream_id = stream_id
        self.code = code
        self.reason = reason
        self.by_peer = by_peer


class ConnectionUnavailable(MeshError):
    """No new stream can be opened on this connection (closing, going away, or absent)."""


class HandshakeInterrupted(HandshakeError):
    """The transport failed or timed out during the handshake; retrying may succeed."""


class DialError(MeshError):
    """Every attempt to reach a peer failed; the message carries the last reason."""
