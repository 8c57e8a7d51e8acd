"""What members of `swim.py` say to each other: the protocol's settings, an update (a change
about one member, with the proof its issuer signed) and a message (PING, ACK, PING-REQ, GOSSIP,
SYNC, SYNC-REPLY, PULL), each with its encoded size. `swim_wire.py` puts them on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import cbor2


class State(Enum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2


@dataclass(frozen=True)
class SwimConfig:
    probe_interval: float = 0.4
    probe_timeout: float = 0.4  # the longest a direct PING's ACK is waited for, then PING-REQs
    rtt_timeouts: float = 3.0  # the direct wait, in smoothed round trips to the target
    min_probe_timeout: float = 0.05
    indirect: int = 3  # members asked to probe a silent target
    indirect_timeout: float = 0.8  # the PING-REQs' answers: two links there and back
    suspicion_min: float = 1.0
    suspicion_max: float = 3.0
    confirmations: int = 3  # suspicions by others that bring the timeout to its minimum
    retransmit: int = 3  # an update rides on retransmit x log2(N + 1) messages
    gossip_interval: float = 0.2
    fanout: int = 3
    max_piggyback: int = 4096  # bytes of updates on one message
    sync_interval: float = 10.0
    signature_bytes: int = 64  # each update is signed by its issuer (counted in sizes)


@dataclass(frozen=True)
class Update:
    """A change about `subject`: its state at an incarnation, with its record's version (and
    the record itself, when it is new) from its own ALIVE."""

    subject: str
    incarnation: int
    state: State
    issuer: str
    record_seq: int = 0
    record: bytes = b""
    # The issuer's signed item that vouches for the change (`swim_proofs.py`); empty on the
    # simulated bus, where `SwimConfig.signature_bytes` stands for it.
    proof: bytes = b""

    def wire(self) -> list:
        return [self.subject, self.incarnation, self.state.value, self.issuer, self.record_seq,
                self.record, self.proof]  # fmt: skip

    def size(self, signature: int) -> int:
        return self.encoded_size + (0 if self.proof else signature)

    @cached_property
    def encoded_size(self) -> int:
        """Its encoded size without the signature, computed once."""
        return len(cbor2.dumps(self.wire()))


@dataclass(frozen=True)
class Message:
    kind: str  # "ping", "ack", "ping-req", "gossip", "sync", "sync-reply"
    seq: int = 0
    target: str = ""  # a PING-REQ's target; an ACK relayed for one
    updates: tuple[Update, ...] = ()
    digest: bytes = b""  # a SYNC's digest of the table
    entries: tuple[Update, ...] = ()  # a SYNC-REPLY's table
    signature: int = 64

    def size(self) -> int:
        return self.encoded_size

    @cached_property
    def encoded_size(self) -> int:
        head = len(cbor2.dumps([self.kind, self.seq, self.target, self.digest]))
        return head + sum(u.size(self.signature) for u in (*self.updates, *self.entries))
