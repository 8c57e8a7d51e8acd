"""Token sampling from logits, in numpy so any engine (or the last stage of a split) uses it."""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

# Nucleus sampling looks at this many top candidates first and sorts the full vocabulary
# only when they do not hold top_p of the probability mass.
_NUCLEUS_CANDIDATES = 64
_SEED_MASK = (1 << 64) - 1  # seeds may be negative; numpy's seed words may not


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These parameters with a seed: a fresh random one where none was given, so that a
        request replayed elsewhere draws the same randomness (`Sampler`)."""
        if self.seed is not None or self.greedy:
            return self
        return replace(self, seed=secrets.randbits(63))


class Sampler:
    """Samples one request's tokens. The randomness of each draw is a function of the seed and
    the token's index in the completion alone, and the penalties count the tokens sampled
    before: so a sampler created with the `history` of a completion (its tokens so far, e.g.
    on another stage after a replay) continues exactly as the first one would have."""

    def __init__(self, params: SamplingParams, history: Sequence[int] = ()) -> None:
        self.params = params
        self._counts: Counter[int] = Counter(history)
        self._index = len(history)  # the completion's index of the next token

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            logits = logits.astype(np.float32, copy=True)
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            n = np.fromiter(self._counts.values(), dtype=np.float32)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * n
        token = int(np.argmax(logits)) if p.greedy else self._sample_random(logits)
        self._counts[token] += 1
        self._index += 1
        return token

    def _rng(self) -> np.random.Generator:
        if self.params.seed is None:
            return np.random.default_rng()
        return np.random.default_rng((self.params.seed & _SEED_MASK, self._index))

    def _sample_random(self, logits: np.ndarray) -> int:
        p = self.params
        rng = self._rng()
        scaled = logits.astype(np.float64) / p.temperature
        scaled -= scaled.max()
        probs = np.exp(scaled)
        probs /= probs.sum()
        if p.top_p < 1.0:
            ids = _nucleus(probs, p.top_p)
            kept = probs[ids]
            return int(ids[rng.choice(len(ids), p=kept / kept.sum())])
        return int(rng.choice(len(probs), p=probs))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Ids of the smallest set of most likely tokens whose mass reaches top_p."""
    k = min(_NUCLEUS_CANDIDATES, len(probs))
    top = np.argpartition(probs, -k)[-k:]
    if probs[top].sum() < top_p:
        top = np.arange(len(probs))
    order = top[np.argsort(-probs[top], kind="stable")]
    cumulative = np.cumsum(probs[order])
    cut = int(np.searchsorted(cumulative, top_p)) + 1
    return order[: max(1, min(cut, len(order)))]
