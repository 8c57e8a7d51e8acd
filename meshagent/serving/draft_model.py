"""A draft model: a small model that proposes the next tokens of a target model's sequences,
for the target to verify in one window (docs/speculation.md, "For a draft model").

Each sequence of the target holds a slot of the draft model's engine. The draft's cache
follows the target's tokens: where the two share a vocabulary, token for token (the draft
keeps its cache while it holds a prefix of the target's sequence and is fed the rest); where
they do not, by their text (`serving/cross_drafts.py`). A proposal is the draft's greedy
continuation, decoded a token at a time in its own cache, and given in the target's tokens.
What the draft decoded stays in its cache, and what the target then confirms is not computed
again.

Blocking (each proposal runs the draft model's forward passes): called from a worker thread,
never the event loop. Every token a proposal feeds the engine is of the draft's own
vocabulary: its tokenizer's or its own argmax (nothing reaches llama.cpp unchecked).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from meshagent.engine.base import Engine, ForwardItem, check_tokens
from meshagent.errors import EngineError
from meshagent.serving.cross_drafts import CrossDrafts, Tokenizer


@dataclass
class _Slot:
    slot: int
    cached: list[int] = field(default_factory=list)  # the draft tokens its engine slot holds
    agreed: list[int] = field(default_factory=list)  # same vocabulary: the target's tokens
    cross: CrossDrafts | None = None  # else: the text both agree on


class DraftModel:
    """Proposals of `engine` (the draft model, whole) for sequences of a target whose
    tokenizer is `target`; `same_vocab`: the two share a vocabulary, token for token."""

    def __init__(self, engine: Engine, target: Tokenizer, *, same_vocab: bool) -> None:
        self.engine = engine
        self.target = target
        self.same_vocab = same_vocab
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(engine.n_slots))
        self.forwards = 0  # forward passes run, for what drafting costs

    def open(self, seq: int, tokens: Sequence[int]) -> bool:
        """Draft for the target's sequence `seq`, which holds `tokens` so far; False where
        every slot is taken (that sequence gets no drafts from the model)."""
        if seq in self._slots:
            raise ValueError(f"sequence {seq} is open already")
        if not self._free:
            return False
        s = _Slot(self._free.pop(0))
        if not self.same_vocab:
            s.cross = CrossDrafts(self.target, self.engine, draft_bos=True)
        self._slots[seq] = s
        self.engine.clear_sequence(s.slot)
        self.extend(seq, tokens)
        return True

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """The target's sequence `seq` went on with `tokens` (verified)."""
        s = self._slots[seq]
        if s.cross is not None:
            s.cross.extend(tokens)
        else:
            s.agreed.extend(tokens)

    def close(self, seq: int) -> None:
        s = self._slots.pop(seq, None)
        if s is not None:
            self.engine.clear_sequence(s.slot)
            self._free.append(s.slot)

    def propose(self, seq: int, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `k` target tokens the draft model expects next (fewer where its text and
        the target's tokens part, or it ends the generation; [] for a closed sequence).
        `after`: target tokens in flight, not verified yet, to propose beyond (as if the
        sequence went on with them; nothing is learnt from them)."""
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
        if feed:
            logits = self._run(s, feed)
        else:  # (its cache holds the text already: the last token's logits again)
            last = s.cached.pop()
            self.engine.trim_sequence(s.slot, len(s.cached))
            logits = self._run(s, [last])
        drafted: list[int] = []
        for i in range(steps):
            token = int(np.argmax(logits))
            drafted.append(token)
            if self.engine.is_end_of_generation(token) or i == steps - 1:
                break
            logits = self._run(s, [token])
        if s.cross is not None:
            s.cross.drafted(drafted[: len(s.cached) - len(s.cross.fed)])
            return s.cross.to_target(drafted)[:k]
        return drafted[:k]

    def _resync(self, s: _Slot, after: Sequence[int]) -> tuple[int, list[int]]:
        """How many of the slot's cached tokens stand, and what to feed after them, for a
        proposal beyond the target's tokens and `after`."""
        if s.cross is not None:
            return s.cross.resync(after)
        follow = [*s.agreed, *after]
        keep = 0
        for a, b in zip(s.cached, follow, strict=False):
            if a != b:
                break
            keep += 1
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
