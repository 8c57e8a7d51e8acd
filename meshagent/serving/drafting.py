"""Drafts for speculative decoding, from the sequence itself, and their verification.

`SuffixDrafter` proposes what followed the most recent earlier occurrence of the sequence's
longest recent suffix (prompt lookup, or N-gram drafting): on copy-shaped text (an edited
document, a renamed variable, JSON with a field changed, quoted tool output) the model mostly
repeats what it has seen, and a draft of several tokens costs one batched forward to check
instead of one forward per token. `DraftLength` sets how many tokens to propose from how many
of the last ones were accepted.

`verify` turns the logits of a window (the sequence's last token, then the draft) into the
tokens plain decoding would have produced: it samples each row with the sequence's own
`Sampler` and keeps going while the sample equals the draft. The first sample that differs is
the token plain decoding would have drawn there, so it is kept too, and nothing after it was
sampled. Because the sampler's randomness is a function of the seed and the token's index
alone (`serving/sampling.py`), the result is identical token for token to decoding without a
draft, at temperature 0 and at any temperature with a seed, penalties included (without a
seed it has the same distribution), wherever each row's logits are those plain decoding would
have computed at that position. An engine that computes a window's batch with other
arithmetic than one-token steps (llama.cpp built with LLAMAFILE) can change the text at a
near tie; agents check their engine when it loads (`engine/windows.py`, docs/speculation.md).
A draft of one fixed continuation is accepted at a position with
the probability the model gives its token there, which is what speculative sampling
(accept with min(1, p/q), q a point mass on the draft) accepts too.

No I/O, no model: plain objects, tested alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from meshagent.serving.sampling import Sampler


class SuffixDrafter:
    """An index of a sequence's n-grams (`min_n` to `max_n` tokens) to the position after
    their most recent occurrence, kept up to date as tokens are added."""

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 6) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> where the tokens after its most recent occurrence start. The suffix that
        # ends the sequence is not indexed until a token follows it: a match is always an
        # earlier occurrence, with at least one token after it.
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, after = self.tokens, self._after
        for token in tokens:
            end = len(toks)  # the n-grams ending here get a token after them now
            for n in range(self.min_n, min(self.max_n, end) + 1):
                after[tuple(toks[end - n : end])] = end
            toks.append(token)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the longest suffix's most recent earlier
        occurrence; () when no suffix of `min_n` tokens or more occurred before."""
        toks = self.tokens
        if k < 1:
            return ()
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            start = self._after.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return tuple(toks[start : start + k])
        return ()


class DraftLength:
    """How many tokens to propose: doubled after a draft accepted whole, cut to one more
    than was accepted otherwise; between 1 and `max_k`. With `backoff`, a draft of which
    nothing was accepted also pauses drafting for 2, 4, 8... up to `max_pause` steps (the
    count restarts after a draft that was at least partly right), so text the drafts do not
    fit costs few wasted windows."""

    def __init__(
        self, initial: int = 4, *, max_k: int = 16, backoff: bool = False, max_pause: int = 64
    ) -> None:
        self.max_k = max_k
        self.k = max(1, min(initial, max_k))
        self.backoff = backoff
        self.max_pause = max_pause
        self._misses = 0
        self._resume_at = 0

    def ready(self, step: int) -> bool:
        """Whether to draft at `step` (a count of the caller's steps)."""
        return step >= self._resume_at

    def update(self, proposed: int, accepted: int, step: int = 0) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.max_k, self.k * 2)
        else:
            self.k = max(1, min(self.max_k, accepted + 1))
        if not self.backoff:
            return
        if accepted:
            self._misses = 0
        else:
            self._misses += 1
            self._resume_at = step + min(self.max_pause, 2**self._misses)


def verify(
    sampler: Sampler,
    rows: Sequence[np.ndarray],
    draft: Sequence[int],
    *,
    is_end: Callable[[int], bool] = lambda token: False,
) -> list[int]:
    """The tokens decoding without a draft would produce from a window's logits. `rows[i]`
    holds the logits after the window's first i + 1 tokens (the sequence's last token, then
    `draft[:i]`), so there is one row more than the draft. Returns the accepted draft tokens
    and then the sampler's own next token: 1 to len(draft) + 1 tokens, ending early at an
    end-of-generation token."""
    if len(rows) != len(draft) + 1:
        raise ValueError(f"a draft of {len(draft)} needs {len(draft) + 1} rows, got {len(rows)}")
    out: list[int] = []
    for i, logits in enumerate(rows):
        token = sampler.sample(logits)
        out.append(token)
        if i == len(draft) or token != draft[i] or is_end(token):
            break
    return out
