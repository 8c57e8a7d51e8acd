"""One push-pull exchange, sans-IO: feed received bytes, send what comes back.

    initiator                         responder
    start() -> DIGEST  ───────────▶   receive_data(): DELTA(items, wants)
    receive_data(): apply, ◀───────
      DELTA(items for wants) ──────▶  receive_data(): apply; done
    done

The trio side (service.py) only moves bytes; everything else (what to send, what to
accept, the limits) happens here and in GossipState.
"""

from __future__ import annotations

from enum import Enum, auto

from meshagent.gossip.errors import ExchangeError
from meshagent.gossip.messages import Busy, Delta, Digest, decode, encode, framing
from meshagent.gossip.state import Change, GossipState
from meshagent.wire.framing import LengthPrefixDecoder


class _Step(Enum):
    START = auto()
    AWAIT_DIGEST = auto()  # responder
    AWAIT_DELTA = auto()  # initiator: the responder's reply
    AWAIT_FINAL = auto()  # responder: the initiator's items
    DONE = auto()


class Exchange:
    def __init__(self, state: GossipState, *, initiator: bool, source: str = "?") -> None:
        self.state = state
        self.initiator = initiator
        self.source = source
        self.changes: list[Change] = []
        self.busy: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._frames = LengthPrefixDecoder(framing(state.config.max_message))
        self._step = _Step.START if initiator else _Step.AWAIT_DIGEST

    @property
    def done(self) -> bool:
        return self._step is _Step.DONE

    def start(self) -> bytes:
        """The initiator's first message: our digest."""
        if self._step is not _Step.START:
            raise ExchangeError("start() is for the initiator, once")
        self._step = _Step.AWAIT_DELTA
        return self._out(encode(Digest(tuple(self.state.digest()))))

    def refuse(self, reason: str) -> bytes:
        """A responder's answer when it will not exchange now (rate limit)."""
        self._step = _Step.DONE
        return self._out(encode(Busy(reason)))

    def receive_data(self, data: bytes, *, now: float) -> bytes:
        """Consume received bytes; returns bytes to send (possibly empty)."""
        if self._step is _Step.DONE:
            if data:
                raise ExchangeError("data after the end of the exchange")
            return b""
        self.bytes_received += len(data)
        self._frames.feed(data)
        out = bytearray()
        while self._step is not _Step.DONE and (frame := self._frames.next_frame()) is not None:
            out += self._handle(decode(frame), now)
        if self._step is _Step.DONE and self._frames.pending:
            raise ExchangeError("data after the end of the exchange")
        return bytes(out)

    def _handle(self, msg: object, now: float) -> bytes:
        budget = self.state.config.max_message
        if isinstance(msg, Delta):
            self._check(msg)
        if self._step is _Step.AWAIT_DIGEST and isinstance(msg, Digest):
            self._step = _Step.AWAIT_FINAL
            items = self.state.items_for(msg.entries, complete=True, budget=budget, now=now)
            wants = tuple(self.state.wants_from(msg.entries))
            return self._out(encode(Delta(items, wants)))
        if self._step is _Step.AWAIT_DELTA and isinstance(msg, Delta):
            self.changes += self.state.apply(msg.items, now=now, source=self.source)
            items = self.state.items_for(msg.wants, complete=False, budget=budget, now=now)
            self._step = _Step.DONE
            return self._out(encode(Delta(items)))
        if self._step is _Step.AWAIT_DELTA and isinstance(msg, Busy):
            self.busy = msg.reason or "busy"
            self._step = _Step.DONE
            return b""
        if self._step is _Step.AWAIT_FINAL and isinstance(msg, Delta):
            if msg.wants:
                raise ExchangeError("the final delta of an exchange carries no wants")
            self.changes += self.state.apply(msg.items, now=now, source=self.source)
            self._step = _Step.DONE
            return b""
        raise ExchangeError(f"unexpected {type(msg).__name__} in step {self._step.name}")

    def _check(self, delta: Delta) -> None:
        """A delta holds at most one item of each kind per member, so never more of a kind
        than the members we track: past that, the sender is not honest."""
        most = self.state.config.max_members
        items = delta.items
        if max(len(items.records), len(items.beats), len(items.obituaries)) > most:
            raise ExchangeError(f"a delta of more items of one kind than {most} members")

    def _out(self, data: bytes) -> bytes:
        self.bytes_sent += len(data)
        return data
