"""Membership-by-probes messages (`swim.py`) on the wire: CBOR, every value checked against
its bounds while it is decoded, so that a member's bad message is refused whole (one
`SwimWireError`, which ends the stream it came on) before anything of it is used.

    [kind, seq, target, digest, updates, entries]
    update: [subject, incarnation, state, issuer, record_seq, record, proof]

Proofs and records are checked later, by `swim_proofs.SwimProofs.verify`, and only for the
updates that would change something.
"""

from __future__ import annotations

from typing import Any

import cbor2

from meshagent.gossip.errors import GossipError
from meshagent.gossip.signed import MAX_BEAT, MAX_ITEM_BYTES
from meshagent.gossip.swim import Message, State, Update
from meshagent.wire.quoted import quoted

KINDS = ("ping", "ack", "ping-req", "gossip", "sync", "sync-reply", "pull")
MAX_MESSAGE = 4 << 20  # bytes of one message (a sync-reply of a full table with records)
MAX_UPDATES = 1024  # updates on one message
MAX_ENTRIES = 4096  # rows of one table
MAX_PROOF = 256  # bytes of a signed heartbeat, suspicion or obituary, with room
MAX_ID = 64  # characters of a peer id
MAX_PULL = 64  # peer ids one pull asks for
_MAX_SEQ = (1 << 63) - 1
_STATES = {s.value: s for s in State}


class SwimWireError(GossipError):
    """A membership message that is not well formed."""


def encode(m: Message) -> bytes:
    return cbor2.dumps(
        [
            KINDS.index(m.kind),
            m.seq,
            m.target,
            m.digest,
            [u.wire() for u in m.updates],
            [u.wire() for u in m.entries],
        ]
    )


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE:
        raise SwimWireError(f"a membership message of {len(data)} bytes is over {MAX_MESSAGE}")
    try:
        d = cbor2.loads(data)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise SwimWireError(f"a membership message is not valid CBOR ({e})") from e
    if not isinstance(d, list) or len(d) != 6:
        raise SwimWireError("a membership message must be a list of 6")
    kind = _int(d[0], len(KINDS) - 1, "kind")
    name = KINDS[kind]
    target = _text(d[2], MAX_ID * MAX_PULL + MAX_PULL if name == "pull" else MAX_ID, "target")
    digest = d[3]
    if not isinstance(digest, bytes) or len(digest) not in (0, 16):
        raise SwimWireError("a digest must be 16 bytes (or none)")
    updates = _updates(d[4], MAX_UPDATES, "updates")
    entries = _updates(d[5], MAX_ENTRIES, "entries")
    return Message(name, _int(d[1], _MAX_SEQ, "seq"), target, updates, digest, entries)


def _updates(v: Any, most: int, what: str) -> tuple[Update, ...]:
    if not isinstance(v, list) or len(v) > most:
        raise SwimWireError(f"{what} must be a list of at most {most}")
    return tuple(_update(u) for u in v)


def _update(v: Any) -> Update:
    if not isinstance(v, list) or len(v) != 7:
        raise SwimWireError("an update must be a list of 7")
    subject, incarnation, state, issuer, record_seq, record, proof = v
    return Update(
        _id(subject, "subject"),
        _int(incarnation, MAX_BEAT, "incarnation"),
        _STATES[_int(state, max(_STATES), "state")],
        _id(issuer, "issuer"),
        _int(record_seq, _MAX_SEQ, "record version"),
        _bytes(record, MAX_ITEM_BYTES, "record"),
        _bytes(proof, MAX_PROOF, "proof"),
    )


def _int(v: Any, most: int, what: str) -> int:
    if type(v) is not int or not 0 <= v <= most:  # (True is an int: not one of these)
        raise SwimWireError(f"{what} must be an integer from 0 to {most}, got {quoted(v)}")
    return v


def _text(v: Any, most: int, what: str) -> str:
    if not isinstance(v, str) or len(v) > most:
        raise SwimWireError(f"{what} must be text of at most {most} characters")
    return v


def _id(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID:
        raise SwimWireError(f"the {what} must be a peer id, got {quoted(v, 40)}")
    return v


def _bytes(v: Any, most: int, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) > most:
        raise SwimWireError(f"a {what} must be bytes, at most {most}")
    return v
