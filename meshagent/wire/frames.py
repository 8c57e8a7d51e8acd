"""Frames: the plaintext inside each record, and the decoder that turns bytes into frames.

    frame = type (u8) || stream id (u32, big-endian) || body

Stream id 0 is the connection itself (PING, PONG, GOAWAY, BYE, and CREDIT for the
connection window); every other frame names a stream. DATA bodies are raw bytes (activations
travel as-is); CREDIT is two u32; control bodies are CBOR maps (see control.py).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import IntEnum

from meshagent.wire.control import (
    MAX_LABEL_LEN,
    MAX_REASON_LEN,
    decode_control,
    encode_control,
    text_field,
    uint_field,
)
from meshagent.wire.errors import ErrorCode, ProtocolError
from meshagent.wire.sealed_records import RecordReader
from meshagent.wire.settings import FRAME_HEADER_LEN

_HEADER = struct.Struct(">BI")
_CREDIT = struct.Struct(">II")
PING_LEN = 8


class FrameType(IntEnum):
    OPEN = 1
    DATA = 2
    CREDIT = 3
    CLOSE = 4
    RESET = 5
    GOAWAY = 6
    PING = 7
    PONG = 8
    BYE = 9


@dataclass(frozen=True, slots=True)
class OpenFrame:
    """Open a stream; the opener grants the peer this much credit for the reverse direction."""

    stream_id: int
    window_bytes: int
    window_frames: int
    label: str = ""


@dataclass(frozen=True, slots=True)
class DataFrame:
    stream_id: int
    payload: bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class CreditFrame:
    """Adds to the peer's send credit on a stream (increments, not absolute values)."""

    stream_id: int
    bytes: int
    frames: int


@dataclass(frozen=True, slots=True)
class CloseFrame:
    """Half-close: the sender sends no more DATA on this stream."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class ResetFrame:
    stream_id: int
    code: ErrorCode
    reason: str = ""


@dataclass(frozen=True, slots=True)
class GoAwayFrame:
    """The sender accepts no new streams; streams up to last_stream_id continue."""

    last_stream_id: int
    code: ErrorCode = ErrorCode.NO_ERROR
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PingFrame:
    opaque: bytes


@dataclass(frozen=True, slots=True)
class PongFrame:
    opaque: bytes


@dataclass(frozen=True, slots=True)
class ByeFrame:
    """The sender is closing the connection now, for this reason."""

    code: ErrorCode
    reason: str = ""


Frame = (
    OpenFrame
    | DataFrame
    | CreditFrame
    | CloseFrame
    | ResetFrame
    | GoAwayFrame
    | PingFrame
    | PongFrame
    | ByeFrame
)


def new_ping() -> PingFrame:
    return PingFrame(os.urandom(PING_LEN))


def data_header(stream_id: int) -> bytes:
    """The 5 bytes that precede a DATA frame's payload."""
    return _HEADER.pack(FrameType.DATA, stream_id)


def encode_data(stream_id: int, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(FrameType.DATA, stream_id) + payload


def encode_frame(frame: Frame) -> bytes:
    match frame:
        case DataFrame(stream_id, payload):
            return encode_data(stream_id, payload)
        case CreditFrame(stream_id, nbytes, nframes):
            return _HEADER.pack(FrameType.CREDIT, stream_id) + _CREDIT.pack(nbytes, nframes)
        case OpenFrame(stream_id, wb, wf, label):
            body = encode_control({1: wb, 2: wf, 3: label})
            return _HEADER.pack(FrameType.OPEN, stream_id) + body
        case CloseFrame(stream_id):
            return _HEADER.pack(FrameType.CLOSE, stream_id)
        case ResetFrame(stream_id, code, reason):
            body = encode_control({1: int(code), 2: reason[:MAX_REASON_LEN]})
            return _HEADER.pack(FrameType.RESET, stream_id) + body
        case GoAwayFrame(last, code, reason):
            body = encode_control({1: int(code), 2: reason[:MAX_REASON_LEN], 3: last})
            return _HEADER.pack(FrameType.GOAWAY, 0) + body
        case PingFrame(opaque):
            return _HEADER.pack(FrameType.PING, 0) + opaque
        case PongFrame(opaque):
            return _HEADER.pack(FrameType.PONG, 0) + opaque
        case ByeFrame(code, reason):
            body = encode_control({1: int(code), 2: reason[:MAX_REASON_LEN]})
            return _HEADER.pack(FrameType.BYE, 0) + body
    raise TypeError(f"not a frame: {frame!r}")


def decode_frame(plaintext: bytes | bytearray) -> Frame:
    """Parse one record's plaintext. Raises ProtocolError, and nothing else, on bad input.

    A DATA frame given as a bytearray is trimmed in place and becomes the payload itself,
    so activations reach the application without another copy.
    """
    if len(plaintext) < FRAME_HEADER_LEN:
        raise ProtocolError(f"frame of {len(plaintext)} bytes is shorter than its header")
    kind, stream_id = _HEADER.unpack_from(plaintext)
    if kind == FrameType.DATA:
        _need_stream(stream_id, "DATA")
        if len(plaintext) == FRAME_HEADER_LEN:
            raise ProtocolError("empty DATA frame")
        if isinstance(plaintext, bytearray):
            del plaintext[:FRAME_HEADER_LEN]
            return DataFrame(stream_id, plaintext)
        return DataFrame(stream_id, memoryview(plaintext)[FRAME_HEADER_LEN:])
    body = memoryview(plaintext)[FRAME_HEADER_LEN:]
    if kind == FrameType.CREDIT:  # on stream 0: credit for the connection as a whole
        if len(body) != _CREDIT.size:
            raise ProtocolError("CREDIT frame body must be 8 bytes")
        nbytes, nframes = _CREDIT.unpack(body)
        return CreditFrame(stream_id, nbytes, nframes)
    if kind == FrameType.OPEN:
        _need_stream(stream_id, "OPEN")
        fields = decode_control(body, "OPEN")
        return OpenFrame(
            stream_id,
            uint_field(fields, 1, "OPEN"),
            uint_field(fields, 2, "OPEN"),
            text_field(fields, 3, "OPEN", limit=MAX_LABEL_LEN),
        )
    if kind == FrameType.CLOSE:
        _need_stream(stream_id, "CLOSE")
        if body:
            raise ProtocolError("CLOSE frame must have an empty body")
        return CloseFrame(stream_id)
    if kind == FrameType.RESET:
        _need_stream(stream_id, "RESET")
        code, reason = _code_reason(body, "RESET")
        return ResetFrame(stream_id, code, reason)
    if kind in (FrameType.PING, FrameType.PONG):
        _need_connection(stream_id, "PING/PONG")
        if len(body) != PING_LEN:
            raise ProtocolError(f"PING/PONG body must be {PING_LEN} bytes")
        cls = PingFrame if kind == FrameType.PING else PongFrame
        return cls(bytes(body))
    if kind == FrameType.GOAWAY:
        _need_connection(stream_id, "GOAWAY")
        fields = decode_control(body, "GOAWAY")
        code, reason = _code_reason_fields(fields, "GOAWAY")
        return GoAwayFrame(uint_field(fields, 3, "GOAWAY"), code, reason)
    if kind == FrameType.BYE:
        _need_connection(stream_id, "BYE")
        code, reason = _code_reason(body, "BYE")
        return ByeFrame(code, reason)
    raise ProtocolError(f"unknown frame type {kind}")


def _need_stream(stream_id: int, what: str) -> None:
    if stream_id == 0:
        raise ProtocolError(f"{what} frame on stream 0")


def _need_connection(stream_id: int, what: str) -> None:
    if stream_id != 0:
        raise ProtocolError(f"{what} frame must be on stream 0, not {stream_id}")


def _code_reason(body: memoryview, what: str) -> tuple[ErrorCode, str]:
    return _code_reason_fields(decode_control(body, what), what)


def _code_reason_fields(fields: dict, what: str) -> tuple[ErrorCode, str]:
    code = ErrorCode.parse(uint_field(fields, 1, what))
    return code, text_field(fields, 2, what, limit=MAX_REASON_LEN)


class FrameDecoder:
    """Bytes in, frames out: records are decrypted and parsed in arrival order.

    Like h11, it never performs I/O: `receive_data` buffers, `next_frame` returns a frame or
    None when it needs more bytes. Everything malformed raises ProtocolError.
    """

    def __init__(self, reader: RecordReader) -> None:
        self._reader = reader

    @property
    def records(self) -> RecordReader:
        """The record reader underneath, for I/O layers that fill its buffer directly."""
        return self._reader

    def receive_data(self, data: bytes) -> None:
        self._reader.receive_data(data)

    def next_frame(self) -> Frame | None:
        plaintext = self._reader.next_record()
        if plaintext is None:
            return None
        return decode_frame(plaintext)
