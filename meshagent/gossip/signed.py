"""Signed gossip items: a peer's record, its heartbeat, and an obituary for a dead peer.

Each item is CBOR `{0: version, ...}` carrying an ed25519 signature. Records and heartbeats
are signed by the peer they describe; an obituary by the peer that declares another dead.
The signed message starts with a per-kind context string that includes the mesh fingerprint,
so an item from one mesh never verifies in another. Public keys travel in the items, and a
peer id is the hash of its key (`peer_id_for`), so every item is self-certifying: nobody can
issue an item for a peer id without that peer's private key. Decoding verifies; an item that
decodes is authentic.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Self

import cbor2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from meshagent.gossip.errors import GossipError, RecordRejected
from meshagent.gossip.peer_record import MAX_RECORD_BYTES, PUBLISHABLE, PeerRecord
from meshagent.identity.keys import NodeIdentity, peer_id_for
from meshagent.wire.quoted import quoted

ITEM_VERSION = 1
MAX_ITEM_BYTES = MAX_RECORD_BYTES + 256
_RECORD_CONTEXT = b"meshagent/gossip-record/v1\x00"
_BEAT_CONTEXT = b"meshagent/gossip-beat/v1\x00"
_OBIT_CONTEXT = b"meshagent/gossip-obituary/v1\x00"
_SUSPECT_CONTEXT = b"meshagent/gossip-suspicion/v1\x00"
_U64 = struct.Struct(">Q")
# The largest beat an item may carry. Beats are wall-clock milliseconds (2**63 ms is some 292
# million years); the headroom above it up to the u64 of the signed message is what keeps
# every beat derived from a received one (a refutation's `beat + 1`, an obituary dated
# forward) representable.
MAX_BEAT = (1 << 63) - 1


@lru_cache(maxsize=4096)
def _peer_id(public_key: bytes) -> str:
    return peer_id_for(public_key)


@lru_cache(maxsize=4096)
def _verify_key(public_key: bytes) -> VerifyKey:
    return VerifyKey(public_key)


def _verify(public_key: bytes, message: bytes, signature: bytes, what: str) -> None:
    try:
        _verify_key(public_key).verify(message, signature)
    except (BadSignatureError, ValueError) as e:
        raise RecordRejected(f"{what}: bad signature (forged or corrupted)") from e


def _load(data: bytes, n: int, what: str) -> dict[int, Any]:
    if len(data) > MAX_ITEM_BYTES:
        raise RecordRejected(f"{what} of {len(data)} bytes is over the limit")
    try:
        d = cbor2.loads(data)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise RecordRejected(f"{what} is not valid CBOR ({e})") from e
    if not isinstance(d, dict) or type(d.get(0)) is not int or d[0] != ITEM_VERSION:
        raise RecordRejected(f"{what} is malformed or of an unsupported version")
    if d.keys() != set(range(n)):
        keys = ", ".join(sorted(quoted(k, 20) for k in d))
        raise RecordRejected(f"{what} must hold keys 0 to {n - 1}, got {keys:.60}")
    return d


def _bytes(v: Any, n: int, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != n:
        raise RecordRejected(f"{what} must be {n} bytes")
    return v


def _beat(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_BEAT:
        raise RecordRejected(f"{what} must be an integer from 0 to {MAX_BEAT}, got {quoted(v)}")
    return v


@dataclass(frozen=True)
class SignedRecord:
    """A PeerRecord with its owner's signature. `raw` is forwarded as received, never
    re-encoded, so the signature always covers the bytes others see."""

    record: PeerRecord
    raw: bytes

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def seq(self) -> int:
        return self.record.seq

    @classmethod
    def sign(cls, record: PeerRecord, identity: NodeIdentity, mesh: str) -> SignedRecord:
        if record.public_key != identity.public_key or record.peer_id != identity.peer_id:
            raise ValueError("a record can only be signed by the peer it describes")
        body = record.to_body()
        sig = identity.sign(_RECORD_CONTEXT + mesh.encode() + body)
        return cls(record, cbor2.dumps({0: ITEM_VERSION, 1: body, 2: sig}))

    @classmethod
    def from_cbor(cls, data: bytes, mesh: str) -> SignedRecord:
        d = _load(data, 3, "record")
        body, sig = d[1], _bytes(d[2], 64, "record signature")
        if not isinstance(body, bytes):
            raise RecordRejected("record body must be bytes")
        record = PeerRecord.from_body(body)
        if _peer_id(record.public_key) != record.peer_id:
            raise RecordRejected(
                f"record claims peer id {record.peer_id} but carries another peer's key"
            )
        _verify(record.public_key, _RECORD_CONTEXT + mesh.encode() + body, sig, "record")
        return cls(record, bytes(data))


def sign_new_record(
    identity: NodeIdentity, mesh: str, fields: dict[str, Any], *, seq: int, wall_time: float
) -> SignedRecord:
    """Our record with `fields` (only `PUBLISHABLE` ones: GossipError names any other), at
    version `seq`, signed; raises if it is too large."""
    unknown = set(fields) - PUBLISHABLE
    if unknown:
        raise GossipError(
            f"unknown record fields: {', '.join(sorted(unknown))} "
            f"(publishable: {', '.join(sorted(PUBLISHABLE))})"
        )
    record = PeerRecord(
        peer_id=identity.peer_id,
        public_key=identity.public_key,
        seq=seq,
        issued_at=round(wall_time, 3),
        **fields,
    )
    return SignedRecord.sign(record, identity, mesh)


@dataclass(frozen=True)
class Heartbeat:
    """`peer_id` is alive as of `beat`. Owners issue increasing beats (wall-clock ms,
    bumped to stay strictly increasing), so a restarted peer's beats supersede old ones."""

    public_key: bytes
    beat: int
    signature: bytes

    @property
    def peer_id(self) -> str:
        return _peer_id(self.public_key)

    @classmethod
    def sign(cls, identity: NodeIdentity, beat: int, mesh: str) -> Heartbeat:
        pk = identity.public_key
        return cls(pk, beat, identity.sign(_BEAT_CONTEXT + mesh.encode() + pk + _U64.pack(beat)))

    def to_cbor(self) -> bytes:
        return cbor2.dumps({0: ITEM_VERSION, 1: self.public_key, 2: self.beat, 3: self.signature})

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat:
        """Parse without verifying (cheap); call `verify` before trusting it."""
        d = _load(data, 4, "heartbeat")
        return cls(
            _bytes(d[1], 32, "heartbeat key"),
            _beat(d[2], "heartbeat beat"),
            _bytes(d[3], 64, "heartbeat signature"),
        )

    def verify(self, mesh: str) -> Heartbeat:
        msg = _BEAT_CONTEXT + mesh.encode() + self.public_key + _U64.pack(self.beat)
        _verify(self.public_key, msg, self.signature, "heartbeat")
        return self


@dataclass(frozen=True)
class _Accusation:
    """`reporter` says something of `subject` as of the subject's beat `beat` (its incarnation,
    in membership by probes): that it is dead (an obituary) or that it did not answer (a
    suspicion). Any later beat from the subject overrides it."""

    subject: str
    beat: int
    reporter_key: bytes
    signature: bytes

    CONTEXT = b""
    WHAT = ""

    @property
    def reporter(self) -> str:
        return _peer_id(self.reporter_key)

    @classmethod
    def _message(cls, mesh: str, subject: str, beat: int, reporter_key: bytes) -> bytes:
        return cls.CONTEXT + mesh.encode() + subject.encode() + _U64.pack(beat) + reporter_key

    @classmethod
    def sign(cls, identity: NodeIdentity, subject: str, beat: int, mesh: str) -> Self:
        pk = identity.public_key
        return cls(subject, beat, pk, identity.sign(cls._message(mesh, subject, beat, pk)))

    def to_cbor(self) -> bytes:
        return cbor2.dumps(
            {
                0: ITEM_VERSION,
                1: self.subject,
                2: self.beat,
                3: self.reporter_key,
                4: self.signature,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Self:
        what = cls.WHAT
        d = _load(data, 5, what)
        subject = d[1]
        if not isinstance(subject, str) or not 0 < len(subject) <= 64:
            raise RecordRejected(f"{what} subject must be a peer id")
        return cls(
            subject,
            _beat(d[2], f"{what} beat"),
            _bytes(d[3], 32, f"{what} reporter key"),
            _bytes(d[4], 64, f"{what} signature"),
        )

    def verify(self, mesh: str) -> Self:
        msg = self._message(mesh, self.subject, self.beat, self.reporter_key)
        _verify(self.reporter_key, msg, self.signature, self.WHAT)
        return self


@dataclass(frozen=True)
class Obituary(_Accusation):
    """`reporter` declares `subject` dead as of the subject's beat `beat`. Any later beat
    from the subject overrides it (the subject is alive after all, or has come back)."""

    CONTEXT = _OBIT_CONTEXT
    WHAT = "obituary"


@dataclass(frozen=True)
class Suspicion(_Accusation):
    """`reporter` probed `subject` at its beat `beat` and got no answer, directly or through
    others (`gossip/swim.py`). Suspicions by distinct reporters shorten the time before the
    subject is declared dead; a later beat from the subject refutes them."""

    CONTEXT = _SUSPECT_CONTEXT
    WHAT = "suspicion"
