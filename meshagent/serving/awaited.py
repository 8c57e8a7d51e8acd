"""What a split's entry awaits from its last stage, per slot (sans-IO): the windows it sent
whose token has not come back, in the order the last stage meets them.

The last stage answers each window it samples after with one Token (or a failure), except a
window that follows another (sent before the verdict on the one before it): that one it
skips as void unless every draft before it was right and its guess is the token the window
before ended with (its `carry`; see `stage_server.py`). The book here plays the same rules
on what the entry sent and the tokens that came back, so it knows which window each Token
answers: a Token for a slot with none awaited, or bringing more tokens than its window's
draft could verify, is a protocol error, and a token for a window whose sequence ended while
it was in flight is nobody's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from meshagent.serving.stage_messages import ForwardItem, StageProtocolError, Token


@dataclass
class _Window:
    draft: tuple[int, ...]  # as sent: a window that follows starts with its guess
    follows: bool
    released: bool = False  # its slot was released after it went: its token is nobody's

    @property
    def verifiable(self) -> int:
        """The most draft tokens its Token may bring after the first."""
        return len(self.draft) - self.follows


_RESET = None  # in a slot's queue: an Open or a Close, where the last stage forgets its carry


class AwaitedWindows:
    def __init__(self) -> None:
        # Per slot: what the last stage has yet to meet, windows and resets, in order.
        self._queues: dict[int, deque[_Window | None]] = {}
        self._carry: dict[int, int] = {}  # per slot, as the last stage holds it
        self.windows = 0  # windows sent whose answer has not come (void ones not counted)

    def clear(self) -> None:
        """A new chain: nothing of the old one is awaited."""
        self._queues.clear()
        self._carry.clear()
        self.windows = 0

    def sent(
        self, released: Sequence[int], opened: Sequence[int], items: Sequence[ForwardItem]
    ) -> None:
        """A step went down the chain: its Closes, its Opens, then its Forward's items."""
        for slot in released:
            for w in self._queues.get(slot, ()):
                if w is not None:
                    w.released = True
            self._queue(slot).append(_RESET)
        for slot in opened:
            self._queue(slot).append(_RESET)
        for it in items:
            if it.sample:
                self._queue(it.seq).append(_Window(it.draft, it.follows))
                self.windows += 1
        for slot in {*released, *opened, *(it.seq for it in items)}:
            self._settle(slot)

    def token(self, msg: Token) -> bool:
        """Check `msg` against the window it answers; whether it is for a live sequence."""
        queue = self._queues.get(msg.seq)
        if not queue:
            raise StageProtocolError(f"a token for sequence {msg.seq}, which awaits none")
        w = queue.popleft()
        assert w is not None  # (`_settle` leaves a window first, or nothing)
        self.windows -= 1
        if len(msg.more) > w.verifiable:
            raise StageProtocolError(
                f"a token for sequence {msg.seq} brings {len(msg.more)} verified drafts, "
                f"its window held {w.verifiable}"
            )
        if len(msg.more) == w.verifiable:  # every draft right: a window may follow
            self._carry[msg.seq] = msg.more[-1] if msg.more else msg.token
        else:
            self._carry.pop(msg.seq, None)
        self._settle(msg.seq)
        return not w.released

    def failure(self, seq: int) -> bool:
        """A failure for `seq` (a stage without its sampler) answers its first window;
        whether that sequence is live."""
        queue = self._queues.get(seq)
        if not queue:
            return False
        w = queue.popleft()
        self.windows -= w is not None
        self._settle(seq)
        return w is not None and not w.released

    def _queue(self, slot: int) -> deque[_Window | None]:
        return self._queues.setdefault(slot, deque())

    def _settle(self, slot: int) -> None:
        """Play what the last stage decides without an answer of its own: resets, and
        windows that follow and are void; stop at the next window it answers."""
        queue = self._queues.get(slot)
        while queue:
            w = queue[0]
            if w is None:
                self._carry.pop(slot, None)
            elif not w.follows or self._carry.get(slot) == w.draft[0]:
                return
            else:  # void: so is every window that follows it
                self._carry.pop(slot, None)
                self.windows -= 1
            queue.popleft()
