"""A draft model: a small model that proposes the next tokens of a target model's sequences,
for the target to verify in one window (docs/speculation.md, "For a draft model").

Each sequence of the target holds a slot of the draft model's engine; a slot keeps its cache
after its sequence ends, and a sequence that starts with the same text (a conversation's next
turn, a prompt again) takes it and reads only what is new. The draft's cache
follows the target's tokens: where the two share a vocabulary, token for token (the draft
keeps its cache while it holds a prefix of the target's sequence and is fed the rest); where
they do not, by their text (`serving/cross_drafts.py`). A proposal is the draft's greedy
continuation, decoded a token at a time in its own cache, and given in the target's tokens.
What the draft decoded stays in its cache, and what the target then confirms is not computed
again.

Blocking (each proposal runs the draft model's forward passes): `propose` is called from one
worker thread, never the event loop; what any other thread tells it (`open`, `extend`,
`close`: appends to an inbox, never a wait) is applied there before the next proposal, so the
engine is only ever called from that thread and the event loop never waits for a draft.
Every token a proposal feeds the engine is checked against the draft's vocabulary (nothing
reaches llama.cpp unchecked): a target's token where the two share one, else its own
tokenizer's or its own argmax.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshagent.engine.base import Engine, ForwardItem, TokenModel, check_tokens
from meshagent.errors import EngineError
from meshagent.serving.cross_drafts import CrossDrafts, Tokenizer


@dataclass
class _Slot:
    slot: int
    cached: list[int] = field(default_factory=list)  # the draft tokens its engine slot holds
    agreed: list[int] = field(default_factory=list)  # same vocabulary: the target's tokens
    cross: CrossDrafts | None = None  # else: the text both agree on


@dataclass
class Reading:
    """Tokens of the target's text a draft model read, and the seconds it took."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def summary(self) -> dict[str, float]:
        return {"tokens": self.tokens, "ms": round(self.seconds * 1000, 1)}


class DraftModel:
    """Proposals of `engine` (the draft model, whole) for sequences of a target whose
    tokenizer is `target`; `same_vocab`: the two share a vocabulary, token for token."""

    def __init__(self, engine: Engine, target: Tokenizer, *, same_vocab: bool) -> None:
        self.engine = engine
        self.name = engine.info.id  # what receipts and the status call it
        self.target = target
        self.same_vocab = same_vocab
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(engine.n_slots))
        # A free slot's last sequence, whose cache its engine slot still holds: a sequence
        # that opens with the same start (a conversation's next turn, a prompt again) takes
        # that slot and keeps what it shares (`_resync`) instead of reading it again.
        self._kept: dict[int, _Slot] = {}
        self.forwards = 0  # forward passes run, for what drafting costs
        self.last_fed = 0  # the last proposal's first forward: how many tokens it fed
        # The last proposal's times: its first forward pass (which fed `last_fed` tokens), and
        # its forward passes of one token after it (how many, in how many seconds). A
        # proposal that catches up on many tokens then still times the model's forward pass.
        self.last_feed_seconds = 0.0
        self.last_steps = 0
        self.last_steps_seconds = 0.0
        # The text it read, in tokens and seconds: ahead of its proposals (`catch_up`, while
        # a split's windows travel), and as a proposal's first forward pass (what a proposal
        # waited on before its first drafted token).
        self.read_ahead = Reading()
        self.read_when_asked = Reading()
        # What the other threads told it, applied by the proposing thread (`_drain`): the
        # engine is only ever called from that one.
        self._inbox: deque[tuple[str, int, tuple[int, ...]]] = deque()

    # ----- from any thread: queued, applied before the next proposal -----

    def open(self, seq: int, tokens: Sequence[int]) -> int:
        """Draft for the target's sequence `seq`, which holds `tokens` so far (where every
        slot is taken, it gets no drafts from the model). How many of `tokens` a free slot
        holds already, from a sequence that ended (an estimate: another sequence may take
        that slot first; what the slot holds is checked when it is taken)."""
        tokens = tuple(tokens)
        self._inbox.append(("open", seq, tokens))
        return max((self._shared(k, tokens) for k in list(self._kept.values())), default=0)

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """The target's sequence `seq` went on with `tokens` (verified)."""
        self._inbox.append(("extend", seq, tuple(tokens)))

    def close(self, seq: int) -> None:
        """The target's sequence `seq` ended: its slot is free."""
        self._inbox.append(("close", seq, ()))

    def _drain(self) -> None:
        while self._inbox:
            op, seq, tokens = self._inbox.popleft()
            s = self._slots.get(seq)
            if op == "open" and s is None and self._free:
                s = self._take_slot(tokens)
                self._slots[seq] = s
                op = "extend"
            if op == "extend" and s is not None:
                if s.cross is not None:
                    s.cross.extend(tokens)
                else:
                    s.agreed.extend(tokens)
            elif op == "close" and s is not None:
                del self._slots[seq]
                self._kept[s.slot] = s  # (its engine slot keeps the cache)
                self._free.append(s.slot)

    def _take_slot(self, tokens: tuple[int, ...]) -> _Slot:
        """A free slot for a sequence that holds `tokens`: the one whose last sequence shares
        the longest start with them, keeping its cache (the slot's draft tokens; across
        tokenizers, what they spell), else a free one emptied: one never used first, so that
        the caches ended sequences left stay for their next turns."""
        shared = {slot: self._shared(self._kept[slot], tokens) for slot in self._kept}
        slot = max(self._free, key=lambda f: (shared.get(f, 0), f not in self._kept))
        self._free.remove(slot)
        kept = self._kept.pop(slot, None)
        s = _Slot(slot)
        if kept is not None and shared[slot] > 0:
            s.cached = kept.cached
            if kept.cross is not None:
                s.cross = kept.cross.reopened()
            return s
        self.engine.clear_sequence(slot)
        if not self.same_vocab:
            s.cross = CrossDrafts(self.target, self.engine, draft_bos=True)
        return s

    def _shared(self, kept: _Slot, tokens: tuple[int, ...]) -> int:
        """How many of the target's `tokens`, from the first, a slot left by `kept` holds
        (across tokenizers: those whose text its draft tokens spell, byte for byte)."""
        if kept.cross is None:
            return _common_start(kept.cached, tokens)
        held, n, at = kept.cross.held_text(), 0, 0
        for t in tokens:
            piece = self.target.token_bytes(t)
            if held[at : at + len(piece)] != piece:
                break
            at += len(piece)
            n += 1
        return n

    # ----- from the proposing thread -----

    def holds(self, seq: int) -> bool:
        """Whether `seq` has a slot (after what it was told)."""
        self._drain()
        return seq in self._slots

    def propose(self, seq: int, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `k` target tokens the draft model expects next (fewer where its text and
        the target's tokens part, or it ends the generation; [] for a closed sequence).
        `after`: target tokens in flight, not verified yet, to propose beyond (as if the
        sequence went on with them; nothing is learnt from them)."""
        self._drain()
        s = self._slots.get(seq)
        if s is None or k < 1:
            return []
        keep, feed = self._resync(s, after)
        room = self.engine.slot_ctx - keep - len(feed)
        steps = min(k + (s.cross is not None), room)  # across tokenizers: one to cut before
        if steps < 1 or not (keep or feed):
            return []
        self.engine.trim_sequence(s.slot, keep)
        del s.cached[keep:]
        self.last_fed = max(1, len(feed))
        started = time.perf_counter()
        if feed:
            logits = self._run(s, feed)
        else:  # (its cache holds the text already: the last token's logits again)
            last = s.cached.pop()
            self.engine.trim_sequence(s.slot, len(s.cached))
            logits = self._run(s, [last])
        fed_at = time.perf_counter()
        self.last_feed_seconds = fed_at - started
        self.read_when_asked.add(len(feed), self.last_feed_seconds)
        drafted: list[int] = []
        self.last_steps = 0
        for i in range(steps):
            token = int(np.argmax(logits))
            drafted.append(token)
            if self.engine.is_end_of_generation(token) or i == steps - 1:
                break
            logits = self._run(s, [token])
            self.last_steps += 1
        self.last_steps_seconds = time.perf_counter() - fed_at
        if s.cross is not None:
            s.cross.drafted(drafted[: len(s.cached) - len(s.cross.fed)])
            return s.cross.to_target(drafted)[:k]
        return drafted[:k]

    def catch_up(self, seq: int, most: int) -> int:
        """Feed `seq`'s slot at most `most` tokens of the text it does not hold yet, and
        propose nothing: a later proposal then feeds less (the entry of a split catches up
        while its windows travel). How many it fed."""
        self._drain()
        s = self._slots.get(seq)
        if s is None or most < 1:
            return 0
        keep, feed = self._resync(s, ())
        if s.cross is not None:
            s.cross.unfed(len(feed) - most)
        feed = feed[: min(most, self.engine.slot_ctx - keep)]
        self.engine.trim_sequence(s.slot, keep)
        del s.cached[keep:]
        if feed:
            started = time.perf_counter()
            self._run(s, feed)
            self.read_ahead.add(len(feed), time.perf_counter() - started)
        return len(feed)

    def _resync(self, s: _Slot, after: Sequence[int]) -> tuple[int, list[int]]:
        """How many of the slot's cached tokens stand, and what to feed after them, for a
        proposal beyond the target's tokens and `after`."""
        if s.cross is not None:
            return s.cross.resync(after)
        follow = [*s.agreed, *after]
        keep = _common_start(s.cached, follow)
        return keep, follow[keep:]

    def _run(self, s: _Slot, tokens: list[int]) -> np.ndarray:
        """Feed `tokens` to the slot; the logits after the last."""
        check_tokens(tokens, self.engine.info.n_vocab)
        (logits,) = self.engine.forward([ForwardItem(s.slot, len(s.cached), tokens, True)])
        self.forwards += 1
        if logits is None:
            raise EngineError("the draft model gave no logits")
        s.cached.extend(tokens)
        return logits


def _common_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the first."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def same_vocabulary(a: TokenModel, b: TokenModel) -> bool:
    """Whether two models' tokens are the same, id for id: as many, each spelling the same
    bytes (a draft model's tokens then go to the target as they are)."""
    n = a.info.n_vocab
    return n == b.info.n_vocab and all(a.token_bytes(t) == b.token_bytes(t) for t in range(n))
