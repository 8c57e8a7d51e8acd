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


def reset_reasons(error: BaseException) -> str | None:
    """The reason when `error` is a stream reset, or a group of nothing but resets (a
    handler's own tasks, such as a stage's upstream and downstream); None otherwise."""
    if isinstance(error, StreamResetError):
        return str(error)
    if isinstance(error, BaseExceptionGroup):
        reasons = [reset_reasons(e) for e in error.exceptions]
        if all(r is not None for r in reasons):
            return "; ".join(r for r in reasons if r is not None)
    return None


class ConnectionUnavailable(MeshError):
    """No new stream can be opened on this connection (closing, going away, or absent)."""


class HandshakeInterrupted(HandshakeError):
    """The transport failed or timed out during the handshake; retrying may succeed."""


class DialError(MeshError):
    """Every attempt to reach a peer failed; the message carries the last reason."""
