"""Token sampling from logits, in numpy so any engine (or the last stage of a split) uses it.

A `Constraint` (a grammar: `engine/grammar.py`) limits which tokens may come next. As in
llama.cpp's own sampler, the token is drawn first from the unconstrained distribution and
kept if the constraint allows it; only otherwise are the disallowed tokens masked and the
draw repeated on what is left. A rejected first draw followed by a draw from the masked
distribution picks each allowed token with its probability renormalised over the allowed
ones, the distribution a mask-first sampler draws from, while the common case (the model's
own choice fits) costs one check instead of a pass over the vocabulary.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from meshagent.engine.base import Constraint
from meshagent.errors import EngineError

# Nucleus sampling looks at this many top candidates first and sorts the full vocabulary
# only when they do not hold top_p of the probability mass.
_NUCLEUS_CANDIDATES = 64
SEEDS = range(1 << 64)  # a seed as the sampler reads it (numpy's seed words are unsigned)


def seed_word(seed: int) -> int:
    """The 64 bits of `seed` the sampler draws with: seeds of any size or sign sample alike,
    so a seed travels between agents as these bits."""
    return seed & (SEEDS.stop - 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # GBNF text the output must follow (`engine/grammar.py`), or None; with a trigger (a
    # regular expression), only from where the output first matches it on.
    grammar: str | None = None
    grammar_trigger: str | None = None
    # A JSON grammar's text must be whole within this many tokens (the request's limit):
    # near it, only tokens that close the JSON are drawn (`engine/json_close.py`).
    close_within: int | None = None
    # Report each token's log-probability and this many most likely alternatives (0-20);
    # None: report none.
    logprobs: int | None = None
    # Draw only from the `top_k` likeliest tokens (0: all); divide a positive logit by
    # `repeat_penalty` (multiply a negative one) for each token the sequence holds (1: none).
    # Anthropic's and ollama's options; llama.cpp's order: penalties, top-k, top-p.
    top_k: int = 0
    repeat_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These parameters with a seed: a fresh random one where none was given, so that a
        request replayed elsewhere draws the same randomness (`Sampler`)."""
        if self.seed is not None or self.greedy:
            return self
        return replace(self, seed=secrets.randbits(63))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (the log-softmax of its logits at
    that step, before penalties, temperature or a grammar), and the `top` most likely tokens
    there with theirs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Samples one request's tokens. The randomness of each draw is a function of the seed and
    the token's index in the completion alone, and the penalties count the tokens sampled
    before: so a sampler created with the `history` of a completion (its tokens so far, e.g.
    on another stage after a replay) continues exactly as the first one would have. A
    `constraint` is advanced through the history too."""

    def __init__(
        self,
        params: SamplingParams,
        history: Sequence[int] = (),
        constraint: Constraint | None = None,
    ) -> None:
        self.params = params
        self._counts: Counter[int] = Counter(history)
        self._index = len(history)  # the completion's index of the next token
        self.constraint = constraint
        if constraint is not None:
            for token in history:
                constraint.accept(token)
        self._logprobs: list[TokenLogprob] = []

    def sample(self, logits: np.ndarray) -> int:
        raw, logits = logits, self._penalised(logits)
        rng = None if self.params.greedy else self._rng()
        token = self._choose(logits, rng)
        if self.constraint is not None and not self.constraint.allows(token):
            masked = self.constraint.mask(logits)
            if not np.isfinite(masked).any():
                raise EngineError("the grammar allows no token here")
            token = self._choose(masked, rng)
        return self._took(raw, token)

    def sample_drafted(self, logits: np.ndarray, token: int, q: np.ndarray | None) -> int:
        """The token at a position a draft model drafted `token` for, drawing it from its own
        distribution `q` over this vocabulary: the standard speculative sampling rule. The
        draft is kept with probability min(1, p / q) (p: this sampler's distribution here),
        else a token is drawn from what p has beyond q (max(0, p - q), normalised). The
        result has exactly p's distribution, and the draft is kept more often than a fixed
        draft would be (the sum of min(p, q) against that of q p). Greedy, or with no `q` (a
        draft from the text, or across tokenizers): `sample` (the draft is kept where it
        equals it). Its randomness is the seed's and the token's index's alone, as
        `sample`'s: a seeded run with the same drafts is the same run."""
        if self.params.greedy or q is None:
            return self.sample(logits)
        probs = self._distribution(logits)
        rng = self._rng()
        u, drafted = rng.random(), float(q[token])
        if drafted > 0 and u * drafted < probs[token]:
            chosen = token
        else:
            beyond = np.maximum(probs - q, 0.0)
            total = beyond.sum()
            # (p = q everywhere leaves nothing beyond, but then the draft was kept)
            chosen = int(rng.choice(len(probs), p=beyond / total if total > 0 else probs))
        return self._took(logits, chosen)

    def _took(self, raw: np.ndarray, token: int) -> int:
        """`token` was sampled from `raw`: the grammar, the log-probabilities, the penalties'
        counts and the index move past it."""
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.params.logprobs is not None:
            self._logprobs.append(logprob_of(raw, token, self.params.logprobs))
        self._counts[token] += 1
        self._index += 1
        return token

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with the presence, frequency and repeat penalties of the tokens so far."""
        p = self.params
        if self._counts and (p.presence_penalty or p.frequency_penalty or p.repeat_penalty != 1):
            logits = logits.astype(np.float32, copy=True)
            ids = np.fromiter(self._counts.keys(), dtype=np.int64)
            n = np.fromiter(self._counts.values(), dtype=np.float32)
            if p.repeat_penalty != 1:
                held = logits[ids]
                logits[ids] = np.where(held > 0, held / p.repeat_penalty, held * p.repeat_penalty)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * n
        return logits

    def _distribution(self, logits: np.ndarray) -> np.ndarray:
        """What `sample` draws from at this position, as probabilities over the vocabulary:
        the penalties, the temperature, top-k, top-p and the grammar."""
        logits = self._penalised(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
            if not np.isfinite(logits).any():
                raise EngineError("the grammar allows no token here")
        probs = self._tempered(logits)
        if self.params.top_p < 1.0:
            ids = _nucleus(probs, self.params.top_p)
            kept = np.zeros_like(probs)
            kept[ids] = probs[ids]
            probs = kept / kept.sum()
        return probs

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens sampled since the last call, in order (none
        unless the parameters ask for them)."""
        out, self._logprobs = self._logprobs, []
        return out

    def _choose(self, logits: np.ndarray, rng: np.random.Generator | None) -> int:
        if rng is None:
            return int(np.argmax(logits))
        return self._sample_random(logits, rng)

    def _rng(self) -> np.random.Generator:
        if self.params.seed is None:
            return np.random.default_rng()
        return np.random.default_rng((seed_word(self.params.seed), self._index))

    def _sample_random(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        probs = self._tempered(logits)
        if self.params.top_p < 1.0:
            ids = _nucleus(probs, self.params.top_p)
            kept = probs[ids]
            return int(ids[rng.choice(len(ids), p=kept / kept.sum())])
        return int(rng.choice(len(probs), p=probs))

    def _tempered(self, logits: np.ndarray) -> np.ndarray:
        """`logits` as probabilities at the temperature, within top-k."""
        p = self.params
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < len(scaled):
            cut = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled >= cut, scaled, -np.inf)
        scaled -= scaled.max()
        probs = np.exp(scaled)
        return probs / probs.sum()


def logprob_of(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-softmax over `logits`, with the `top` most likely tokens' (ties in id
    order)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, len(x))
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.lexsort((ids, -x[ids]))]
        best = tuple((int(i), float(x[i] - lse)) for i in ids)
    return TokenLogprob(float(x[token] - lse), best)


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
