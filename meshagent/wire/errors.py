"""Error codes carried on the wire and the protocol's own exception types."""

from __future__ import annotations

from enum import IntEnum

from meshagent.errors import MeshError


class ErrorCode(IntEnum):
    """Why a stream was reset or a connection ended; carried in RESET, GOAWAY and BYE."""

    NO_ERROR = 0  # orderly end
    PROTOCOL_ERROR = 1  # the peer broke a rule of this protocol
    INTERNAL_ERROR = 2  # a bug or an unexpected failure on the sender's side
    FLOW_CONTROL_ERROR = 3  # data beyond the granted credit, or a credit overflow
    REFUSED_STREAM = 4  # stream not accepted (going away, too many streams); safe to retry
    CANCEL = 5  # the application abandoned the stream
    REPLACED = 6  # the connection was replaced by a newer/better one (drain-and-close)
    STREAM_CLOSED = 7  # data after the peer had half-closed its side
    FRAME_TOO_LARGE = 8  # a record or frame larger than the negotiated maximum
    SHUTDOWN = 9  # the node is stopping
    UNRESPONSIVE = 10  # no PONG for the dead-peer timeout
    REFUSED = 11  # the connection was not taken: over a budget (connections per peer, in all)

    @classmethod
    def parse(cls, value: int) -> ErrorCode:
        """Unknown codes from newer peers read as INTERNAL_ERROR rather than failing."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL_ERROR


class ProtocolError(MeshError):
    """The peer sent something this protocol does not allow; the connection must end."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class HandshakeError(ProtocolError):
    """The handshake failed: wrong mesh, bad identity proof, version mismatch or garbage."""


class FramingError(MeshError):
    """A length-prefixed frame is over its protocol's limit; what it came on cannot continue.

    The default error of `meshagent.wire.framing`; each protocol names its own instead."""


class LocalUsageError(MeshError):
    """The local application asked for something the connection state does not allow."""
