"""CBOR bodies of control frames: maps with small integer keys and a version under key 0."""

from __future__ import annotations

import io
from typing import Any

import cbor2

from meshagent.wire.errors import ProtocolError
from meshagent.wire.quoted import quoted

CONTROL_VERSION = 1
MAX_REASON_LEN = 1024
MAX_LABEL_LEN = 256


def encode_control(fields: dict[int, Any]) -> bytes:
    return cbor2.dumps({0: CONTROL_VERSION, **fields})


def decode_control(body: bytes | memoryview, what: str) -> dict[int, Any]:
    """Decode one control map; anything else (garbage, trailing bytes, other version,
    non-integer keys) raises ProtocolError naming the frame type."""
    fp = io.BytesIO(body)
    try:
        value = cbor2.CBORDecoder(fp).decode()
    except Exception as e:  # cbor2 raises many types on hostile input (incl. RecursionError)
        raise ProtocolError(f"{what} frame body is not valid CBOR") from e
    if fp.tell() != len(body):
        raise ProtocolError(f"{what} frame body has trailing bytes")
    if not isinstance(value, dict) or not all(type(k) is int for k in value):
        raise ProtocolError(f"{what} frame body is not a map with integer keys")
    if value.get(0) != CONTROL_VERSION:
        raise ProtocolError(f"{what} frame body has unsupported version {quoted(value.get(0))}")
    return value


def uint_field(body: dict[int, Any], key: int, what: str, *, bits: int = 32) -> int:
    value = body.get(key)
    if type(value) is not int or not 0 <= value < (1 << bits):
        raise ProtocolError(f"{what} field {key} must be an unsigned {bits}-bit integer")
    return value


def text_field(body: dict[int, Any], key: int, what: str, *, limit: int) -> str:
    value = body.get(key, "")
    if type(value) is not str or len(value) > limit:
        raise ProtocolError(f"{what} field {key} must be text of at most {limit} characters")
    return value
