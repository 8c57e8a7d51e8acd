"""Per-connection stream settings each side announces in its handshake payload."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.wire.errors import HandshakeError

# A record on the wire is at most this big; a larger length prefix is refused before reading.
MAX_RECORD_PLAINTEXT = 1 << 20
FRAME_HEADER_LEN = 5  # type (1) + stream id (4)
MAX_FRAME_PAYLOAD_LIMIT = MAX_RECORD_PLAINTEXT - FRAME_HEADER_LEN
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class StreamSettings:
    """What this side grants the peer: receive windows for each new stream, the largest DATA
    payload it accepts, how many concurrently open streams the peer may open, and the bytes
    it may have unread here on all its streams together (`connection_window_bytes`: one
    budget for the connection's receive buffers, however many streams are open)."""

    window_bytes: int = 4 << 20
    window_frames: int = 256
    max_frame_payload: int = 256 * 1024
    max_streams: int = 256
    connection_window_bytes: int = 64 << 20
    version: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.window_bytes <= _U32 or not 1 <= self.window_frames <= _U32:
            raise ValueError("stream windows must be between 1 and 2**32-1")
        if not 1 <= self.max_frame_payload <= MAX_FRAME_PAYLOAD_LIMIT:
            raise ValueError(f"max_frame_payload must be between 1 and {MAX_FRAME_PAYLOAD_LIMIT}")
        if not 1 <= self.max_streams <= _U32:
            raise ValueError("max_streams must be between 1 and 2**32-1")
        if not self.max_frame_payload <= self.connection_window_bytes <= _U32:
            raise ValueError(
                "connection_window_bytes must be between max_frame_payload and 2**32-1"
            )

    def to_cbor(self) -> dict[int, int]:
        """A cbor-ready map; embedded in the handshake payload rather than sent on its own."""
        return {
            0: self.version,
            1: self.window_bytes,
            2: self.window_frames,
            3: self.max_frame_payload,
            4: self.max_streams,
            5: self.connection_window_bytes,
        }

    @classmethod
    def from_cbor(cls, value: object) -> StreamSettings:
        if not isinstance(value, dict):
            raise HandshakeError("peer's stream settings are not a map")
        values = [value.get(k) for k in (1, 2, 3, 4)]
        if not all(type(v) is int for v in values):
            raise HandshakeError("peer's stream settings are missing fields or not integers")
        wb, wf, mfp, ms = values
        cw = value.get(5, _U32)  # absent: the peer sets no connection budget
        if type(cw) is not int:
            raise HandshakeError("peer's connection window is not an integer")
        try:
            return cls(
                window_bytes=wb,
                window_frames=wf,
                max_frame_payload=mfp,
                max_streams=ms,
                connection_window_bytes=cw,
            )
        except ValueError as e:
            raise HandshakeError(f"peer's stream settings are invalid: {e}") from e
