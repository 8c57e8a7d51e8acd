"""Events the multiplexer reports to the I/O layer, in the order they happened (like h11)."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.wire.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """The peer opened a stream; the application should accept it."""

    stream_id: int
    label: str


@dataclass(frozen=True, slots=True)
class DataReceived:
    """Bytes were buffered for the stream; `Multiplexer.read` returns them."""

    stream_id: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The peer half-closed the stream: once buffered data is read, reads return EOF."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream is dead. `by_peer` says whether the peer reset it or we did (for example
    because the peer broke a stream-level rule). Buffered data is discarded."""

    stream_id: int
    code: ErrorCode
    reason: str
    by_peer: bool


@dataclass(frozen=True, slots=True)
class CreditGranted:
    """The peer granted send credit on the stream; a blocked sender may continue."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class GoAway:
    """The peer takes no new streams on this connection; open them elsewhere."""

    last_stream_id: int
    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True)
class PingAcked:
    rtt: float


@dataclass(frozen=True, slots=True)
class ConnectionTerminated:
    """The peer sent BYE: the connection is over, for this reason."""

    code: ErrorCode
    reason: str


Event = (
    StreamOpened
    | DataReceived
    | StreamClosed
    | StreamReset
    | CreditGranted
    | GoAway
    | PingAcked
    | ConnectionTerminated
)
