"""The tokens of the scale simulation's requests, computed on fake splits (`fake_engine.py`).

Each chain the simulation serves on is a fake split of as many stages as the chain has: a
`FakeEntry` (the text side and the first stage) and a `FakeStage` for each later one, with
`SLOTS` sequences each. A request that starts on a chain, or replays on one after its chain
was lost, takes a free slot there and prefills its prompt and the tokens it has; each token
it decodes then goes through every stage, and the last stage's logits choose it (greedy). The
fake's logits depend on every token a sequence holds and on its positions, so a replay that
lost, doubled or reordered a token would change the text: `reference` is what the whole
model gives, and a finished request's tokens must be exactly that.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from meshagent.engine.runtime import EmbdItem
from meshagent.testing.fake_engine import FakeEntry, FakeStage, fake_logits

N_VOCAB = 64


def prompt_of(rid: int, n: int) -> list[int]:
    """Request `rid`'s prompt: `n` token ids of its own (never the end token)."""
    rng = random.Random(rid)
    return [rng.randrange(2, N_VOCAB) for _ in range(n)]


def reference(prompt: Sequence[int], output: int) -> list[int]:
    """The `output` tokens the whole model decodes greedily after `prompt`."""
    held, out = list(prompt), []
    for _ in range(output):
        token = int(np.argmax(fake_logits(held, N_VOCAB)))
        held.append(token)
        out.append(token)
    return out


class _FakeSplit:
    """One chain as a fake split: the entry, then each later stage, the last giving logits."""

    def __init__(self, stages: int, slots: int, slot_ctx: int) -> None:
        self.entry = FakeEntry(N_VOCAB, slots=slots, slot_ctx=slot_ctx)
        self.later = [
            FakeStage(last=i == stages - 1, n_vocab=N_VOCAB, slots=slots, slot_ctx=slot_ctx)
            for i in range(1, max(2, stages))
        ]
        self.holders: list[int | None] = [None] * slots  # the request in each slot

    def run(self, slot: int, pos: int, tokens: list[int]) -> int:
        """Feed `tokens` at `pos` through every stage; the next token (greedy)."""
        rows = self.entry.run_first([(slot, pos, tokens)])[0]
        logits = None
        for stage in self.later:
            out = stage.forward([EmbdItem(slot, pos, rows, want_logits=int(stage.last))])
            if stage.last:
                logits = out.logits[0]
            else:
                rows = out.hidden[0]
        assert logits is not None
        return int(np.argmax(logits))

    def clear(self, slot: int) -> None:
        self.entry.clear_sequence(slot)
        for stage in self.later:
            stage.clear_sequence(slot)


class FakeChains:
    """Every chain's fake split, and where each request's sequence is held."""

    def __init__(self, slots: int, slot_ctx: int) -> None:
        self.slots, self.slot_ctx = slots, slot_ctx
        self._splits: dict[tuple, _FakeSplit] = {}
        # rid -> (chain key, slot, the next token, its position)
        self._held: dict[int, tuple[tuple, int, int, int]] = {}
        self.tokens = 0  # tokens computed, prefills included

    def start(self, rid: int, key: tuple, stages: int, held: list[int]) -> None:
        """Request `rid` starts (or replays) on chain `key`: a free slot prefills `held`
        (its prompt and the tokens it has), which gives the next token."""
        self.release(rid)
        split = self._splits.get(key)
        if split is None:
            split = self._splits[key] = _FakeSplit(stages, self.slots, self.slot_ctx)
        slot = split.holders.index(None)  # the simulation keeps a chain to `slots` requests
        split.holders[slot] = rid
        split.clear(slot)
        nxt = split.run(slot, 0, held)
        self.tokens += len(held)
        self._held[rid] = (key, slot, nxt, len(held))

    def decode(self, rid: int, tokens: list[int], upto: int) -> None:
        """Decode request `rid`'s tokens on its chain until it has `upto` (appended to
        `tokens`, which holds those it has, its prompt not included)."""
        key, slot, nxt, pos = self._held[rid]
        split = self._splits[key]
        while len(tokens) < upto:
            tokens.append(nxt)
            nxt = split.run(slot, pos, [nxt])
            pos += 1
            self.tokens += 1
        self._held[rid] = (key, slot, nxt, pos)

    def release(self, rid: int) -> None:
        """Request `rid` no longer runs where it was (finished, failed, or its chain lost)."""
        held = self._held.pop(rid, None)
        if held is not None:
            self._splits[held[0]].holders[held[1]] = None
