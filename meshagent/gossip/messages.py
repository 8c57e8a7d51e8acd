"""Gossip wire messages and their framing: `u32 length || CBOR message`.

An exchange is three messages (push-pull anti-entropy, as in Scuttlebutt):
  1. initiator -> responder  DIGEST  what the initiator knows, one entry per peer
  2. responder -> initiator  DELTA   items the initiator lacks, plus the responder's digest
                                     entries for the peers where the initiator knows more
  3. initiator -> responder  DELTA   items the responder lacks (per those entries)
A responder that refuses (rate limit) answers message 1 with BUSY.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import cbor2

from meshagent.gossip.errors import ExchangeError
from meshagent.gossip.signed import MAX_BEAT
from meshagent.wire.framing import Framing
from meshagent.wire.quoted import quoted

MESSAGE_VERSION = 1
T_DIGEST, T_DELTA, T_BUSY = 1, 2, 3
# The u32 is the only limit here: a receiver applies its own (`framing(max_message)`).
FRAMING = Framing("gossip message", width=4, max_size=(1 << 32) - 1, error=ExchangeError)
MAX_DIGEST_ENTRIES = 4096
MAX_ITEMS = 4096  # of each kind in one delta (a receiver also holds them to its max_members)
MAX_REASON = 200  # characters of a BUSY's reason
_U64 = 1 << 64


@dataclass(frozen=True, order=True)
class DigestEntry:
    """What one side knows of one peer: its record's seq, the newest heartbeat beat it has
    heard of (from a heartbeat or an obituary), and whether it holds an obituary."""

    peer_id: str
    seq: int = 0
    beat: int = 0
    dead: bool = False

    @property
    def liveness(self) -> tuple[int, bool]:
        return (self.beat, self.dead)

    def to_wire(self) -> list[Any]:
        return [self.peer_id, self.seq, self.beat, self.dead]

    @classmethod
    def from_wire(cls, v: Any) -> DigestEntry:
        if (
            not isinstance(v, list)
            or len(v) != 4
            or not isinstance(v[0], str)
            or not 0 < len(v[0]) <= 64
            or not _in_range(v[1], _U64 - 1)
            or not _in_range(v[2], MAX_BEAT)
            or not isinstance(v[3], bool)
        ):
            raise ExchangeError(f"malformed digest entry {quoted(v, 80)}")
        return cls(v[0], v[1], v[2], v[3])


def _in_range(v: Any, most: int) -> bool:
    """`v` is an integer from 0 to `most` (True and 1.0 equal 1, but are no integers here)."""
    return type(v) is int and 0 <= v <= most


@dataclass(frozen=True)
class Items:
    """Encoded signed items, forwarded as received (see signed.py)."""

    records: tuple[bytes, ...] = ()
    beats: tuple[bytes, ...] = ()
    obituaries: tuple[bytes, ...] = ()

    def __len__(self) -> int:
        return len(self.records) + len(self.beats) + len(self.obituaries)


@dataclass(frozen=True)
class Digest:
    entries: tuple[DigestEntry, ...]


@dataclass(frozen=True)
class Delta:
    items: Items
    wants: tuple[DigestEntry, ...] = ()


@dataclass(frozen=True)
class Busy:
    reason: str = ""


Message = Digest | Delta | Busy


def encode(msg: Message) -> bytes:
    if isinstance(msg, Digest):
        body = {0: MESSAGE_VERSION, 1: T_DIGEST, 2: [e.to_wire() for e in msg.entries]}
    elif isinstance(msg, Delta):
        body = {
            0: MESSAGE_VERSION,
            1: T_DELTA,
            3: list(msg.items.records),
            4: list(msg.items.beats),
            5: list(msg.items.obituaries),
            6: [e.to_wire() for e in msg.wants],
        }
    else:
        body = {0: MESSAGE_VERSION, 1: T_BUSY, 7: msg.reason}
    return FRAMING.encode(cbor2.dumps(body))


def _byte_strings(v: Any) -> tuple[bytes, ...]:
    if not isinstance(v, list) or len(v) > MAX_ITEMS or not all(isinstance(x, bytes) for x in v):
        raise ExchangeError("delta items must be lists of byte strings")
    return tuple(v)


def _entries(v: Any) -> tuple[DigestEntry, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIGEST_ENTRIES:
        raise ExchangeError("digest must be a list of at most 4096 entries")
    return tuple(DigestEntry.from_wire(e) for e in v)


def decode(data: bytes) -> Message:
    try:
        d = cbor2.loads(data)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise ExchangeError(f"gossip message is not valid CBOR ({e})") from e
    if not isinstance(d, dict) or type(d.get(0)) is not int or d[0] != MESSAGE_VERSION:
        raise ExchangeError("gossip message is malformed or of an unsupported version")
    kind = d.get(1)
    if not _in_range(kind, T_BUSY):
        raise ExchangeError(f"unknown gossip message type {quoted(kind)}")
    if kind == T_DIGEST:
        return Digest(_entries(d.get(2)))
    if kind == T_DELTA:
        items = Items(_byte_strings(d.get(3)), _byte_strings(d.get(4)), _byte_strings(d.get(5)))
        return Delta(items, _entries(d.get(6, [])))
    if kind == T_BUSY:
        reason = d.get(7, "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise ExchangeError(f"a busy reason is text of at most {MAX_REASON} characters")
        return Busy(reason)
    raise ExchangeError(f"unknown gossip message type {quoted(kind)}")


def framing(max_message: int) -> Framing:
    """Gossip's framing for a receiver that refuses messages over `max_message` bytes."""
    return replace(FRAMING, max_size=max_message)
