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

from meshagent.serving.blocks import BlockEnd
from meshagent.serving.copying import COPYING, Copier, Cursor, Joined, TokenNames
from meshagent.serving.mentions import mentioned_names, mentioned_numbers, number_positions
from meshagent.serving.sampling import Sampler

# The most tokens a draft holds: a window of 16 tokens with the sequence's last one. llama.cpp's
# CPU matrix products take a batch's tokens 16 at a time, so a 17th costs about twice what
# each token before it did (measured on a 2-core EPYC, Qwen2.5-Coder-1.5B: 16 tokens 7.5
# one-token steps, 17 tokens 8.4; SmolLM2: 6.5 and 7.2), and a window of 16 yields the most
# tokens per step there. Where a window costs little more than a step (a GPU), a 17th token
# would add a sixteenth to a window.
MAX_DRAFT = 15
# How often a copy goes on as its source does, before evidence (and how many tokens that
# prior weighs): about what the benchmark's JSON and code copies showed at their start. The
# evidence fades by FOLLOW_DECAY a token, so a copy that turns into new text shows soon.
FOLLOW_PRIOR, FOLLOW_WEIGHT, FOLLOW_DECAY = 0.9, 4.0, 0.98
# What a miss that taught the drafter an edit of a copy counts for, once the edit is confirmed:
# half of one. A learnt edit is drafted right wherever it comes up again (a renamed variable's
# later uses), so its first miss says less about the misses to come than one that taught
# nothing; but not nothing, since a text that edits once may edit elsewhere too.
EDIT_MISS = 0.5


class SuffixDrafter:
    """An index of a sequence's n-grams (`min_n` to `max_n` tokens) to the position after
    their most recent occurrence, kept up to date as tokens are added, and a cursor on the
    text the sequence is copying from, with the edits it made (`serving/copying.py`).

    `follow` is how often the copy goes on: of the tokens that came while the cursor followed
    its source and would have drafted the next one (`copying`, and not a token it stops
    before), the share that the source, with its edits, had right. Every token counts, drafted
    or not, so a sequence knows how well it copies before it drafts; misses are the edits
    (a miss that taught an edit of a copy counts `EDIT_MISS` of one).

    `block`, where one is set (`answering`), follows the answer's text, and a draft stops
    where the answer's block closes (`serving/blocks.py`)."""

    def __init__(
        self,
        tokens: Iterable[int] = (),
        *,
        min_n: int = 2,
        max_n: int = 6,
        name: Callable[[int], str | None] | None = None,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> where the tokens after its most recent occurrence start. The suffix that
        # ends the sequence is not indexed until a token follows it: a match is always an
        # earlier occurrence, with at least one token after it.
        self._after: dict[tuple[int, ...], int] = {}
        self.copier = Copier(name)  # `name`: what identifier a token spells, if any
        self.cursor: Cursor | None = None  # set by the tokens added after these
        self.follow = Rate(FOLLOW_PRIOR, FOLLOW_WEIGHT, FOLLOW_DECAY)
        for token in tokens:
            self._index(token)
        self.block: BlockEnd | None = None

    @classmethod
    def answering(
        cls, prompt: Sequence[int], history: Sequence[int] = (), names: TokenNames | None = None
    ) -> SuffixDrafter:
        """A drafter for the answer to `prompt` that has written `history` so far; with the
        vocabulary's `names`, it tells renamed names, the names the request mentions, and
        where the answer's block ends."""
        drafter = cls((*prompt, *history), name=names)
        if names is not None:
            drafter.block = BlockEnd(names.text, history)
            texts = [names.text(t) for t in prompt]
            request = "".join(texts)
            drafter.copier.mentioned = mentioned_names(request)
            drafter.copier.doubtful = number_positions(texts, mentioned_numbers(request))
        return drafter

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def copying(self) -> bool:
        """Whether its next draft goes on copying the text the sequence has been following."""
        return self.cursor is not None and self.cursor.following and self.cursor.trusted

    def _index(self, token: int) -> None:
        toks, end = self.tokens, len(self.tokens)  # the n-grams ending here get a token now
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._after[tuple(toks[end - n : end])] = end
        toks.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        """Add generated tokens: the cursor follows them (and learns the edits they make);
        where there is none (yet, or no more: the text went elsewhere), the most recent
        earlier occurrence of the longest suffix becomes its source."""
        for token in tokens:
            if self.cursor is not None:
                judged, learnt = self._judged(self.cursor), self.copier.learnt
                self.cursor = self.copier.step(self.tokens, self.cursor, token, learn=True)
                if judged:
                    self.follow.update(int(self.cursor is not None and self.cursor.following), 1)
                if self.copier.learnt > learnt and self.cursor and self.cursor.run >= COPYING:
                    self.follow.take_back(1 - EDIT_MISS)  # the miss that began the edit
            self._index(token)
            if self.block is not None:
                self.block.extend((token,))
            if self.cursor is None:
                start = self._match(self.tokens)
                if start is not None:
                    self.cursor = Cursor(start)

    def _judged(self, cur: Cursor) -> bool:
        """Whether the next token tells how well the copy goes on: the cursor would draft it."""
        if not (cur.following and cur.trusted):
            return False
        return bool(cur.pending) or (
            cur.at < len(self.tokens) and not self.copier.stops_at(self.tokens, cur.at)
        )

    def _match(self, tail: Sequence[int]) -> int | None:
        """Where the tokens after the longest suffix of `tail` (`min_n` tokens or more) start,
        at its most recent earlier occurrence."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            start = self._after.get(tuple(tail[len(tail) - n :]))
            if start is not None:
                return start
        return None

    def propose(self, k: int, after: Sequence[int] = ()) -> tuple[int, ...]:
        """Up to `k` tokens: the copied text from the cursor on, with the edits made; else
        what followed the longest suffix's most recent earlier occurrence; () when no suffix
        of `min_n` tokens or more occurred before. With `after`, as if the sequence went on
        with those tokens (drafts not yet verified: what to draft next, beyond them), without
        indexing them or learning from them. Stops where the answer's block closes."""
        got = self._propose(k, after)
        if self.block is not None and got:
            got = got[: self.block.keep(got, after)]
        return got

    def _propose(self, k: int, after: Sequence[int]) -> tuple[int, ...]:
        if k < 1:
            return ()
        cur, joined = self.cursor, Joined(self.tokens, after)
        for i, token in enumerate(after):
            if cur is None:
                break
            joined.taken = i  # the text before this draft token
            cur = self.copier.step(joined, cur, token, learn=False)
        joined.taken = len(after)
        text = joined if after else self.tokens
        if cur is not None and cur.trusted:
            got, stopped = self.copier.draft(text, cur, k)
            if got or stopped:  # (stopped at once: the model's own token decides there)
                return got
        tail = [*self.tokens[-self.max_n :], *after][-self.max_n :] if after else self.tokens
        start = self._match(tail)
        if start is None:
            return ()
        got = self.tokens[start : start + k]  # and on into `after`, where the match is recent
        if len(got) < k and after:
            got = [*got, *after[: k - len(got)]]
        return tuple(got)


class DraftLength:
    """How many tokens to propose ("on"): doubled after a draft accepted whole, cut to one
    more than was accepted otherwise; between 1 and `max_k`."""

    def __init__(self, initial: int = 4, *, max_k: int = MAX_DRAFT) -> None:
        self.max_k = max_k
        self.k = max(1, min(initial, max_k))

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.k = min(self.max_k, self.k * 2)
        else:
            self.k = max(1, min(self.max_k, accepted + 1))


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


class WindowCost:
    """What a step of n tokens costs relative to a step of one, learnt from the steps run:
    cost(n) = 1 + jump + slope * (n - 1) for n > 1. On a CPU that computes each token's
    products on its own (small batches are compute-bound), slope is near 1 and a window is
    nearly as dear as its tokens decoded one by one; where a step's time is mostly fixed
    (weights read from memory once, a GPU, a round trip through a split), slope is small and
    windows are cheap. `jump` is what any window costs over a one-token step beyond that
    (llama.cpp on a CPU takes another path for a batch of two or more: a window of 2 tokens
    measured 1.9 steps, each further token 0.6).

    Each size of step seen keeps a moving average of its time. A line through the sizes of
    two tokens or more (least squares, sizes weighted by how often they were seen) gives
    time(n) = a + b * n; with the time of one token, slope = b / time(1) and jump =
    (a + b) / time(1) - 1. With one size of window only, the line goes through the one-token
    time (no jump); with no one-token step (a split's entry that drafts on every trip), through
    the windows alone. With fewer than two sizes seen, the prior holds."""

    _SIZES = 64  # steps of more tokens than this are not counted
    TRUSTED = 3  # steps of a size timed before their own time stands for that size

    def __init__(self, slope: float = 0.3, *, weight: float = 0.2) -> None:
        self.slope = slope
        self.jump = 0.0
        self.weight = weight
        self._seen: dict[int, float] = {}  # tokens -> moving mean of its seconds
        self._total: dict[int, tuple[float, int]] = {}  # tokens -> (seconds, count), all steps

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode step of `tokens` tokens (one per sequence, plus drafts) took `seconds`."""
        if not 1 <= tokens <= self._SIZES or seconds <= 0:
            return
        spent, steps = self._total.get(tokens, (0.0, 0))
        self._total[tokens] = (spent + seconds, steps + 1)
        if not self.weight:
            return  # (with weight 0 the slope stays as set)
        mean = self._seen.get(tokens, seconds)
        self._seen[tokens] = mean + self.weight * (seconds - mean)
        if len(self._seen) >= 2:
            self._fit()

    def _fit(self) -> None:
        windows = {n: v for n, v in self._seen.items() if n > 1}
        seen = windows if len(windows) >= 2 else self._seen
        line = _line({n: (t, self._total[n][1]) for n, t in seen.items()})
        if line is None:
            return
        a, b = line
        one = self._seen[1] if 1 in self._seen else a + b
        if one <= 0:
            self.slope, self.jump = 2.0, 0.0
            return
        self.slope = min(2.0, b / one)
        self.jump = min(2.0, max(0.0, (a + b) / one - 1)) if len(windows) >= 2 else 0.0

    def cost(self, tokens: int) -> float:
        """A step of `tokens` against one of one token: what steps of that size took where
        at least `TRUSTED` were timed beside one-token steps, else the line. (The line
        through every size misses where cost bends: on a CPU split, windows of 2-4 tokens
        took 2.2-3.4 steps where the line through them and 16-token ones said 2.0-3.2, and
        drafts the line said paid by 5% lost 6%.)"""
        if tokens <= 1:
            return 1.0
        one, seen = self._seen.get(1), self._seen.get(tokens)
        if one and seen is not None and self._total[tokens][1] >= self.TRUSTED:
            return seen / one
        return 1 + self.jump + self.slope * (tokens - 1)

    def step_seconds(self) -> float | None:
        """What a one-token step takes, in seconds: its moving mean where such steps ran,
        else the line through the windows at one token; None before two sizes were timed."""
        if 1 in self._seen:
            return self._seen[1]
        if len(self._seen) < 2:
            return None
        line = _line({n: (t, self._total[n][1]) for n, t in self._seen.items()})
        if line is None or sum(line) <= 0:
            return None
        return sum(line)

    def summary(self) -> dict[str, object]:
        """The line as fitted now, and every size of step timed since the start: how many
        and their mean time (all of them, not the moving average the line follows)."""
        return {
            "slope": round(self.slope, 4),
            "jump": round(self.jump, 4),
            "steps": {
                str(n): {"count": c, "mean_ms": round(t / c * 1000, 3)}
                for n, (t, c) in sorted(self._total.items())
            },
        }


def _line(seen: dict[int, tuple[float, int]]) -> tuple[float, float] | None:
    """time(n) = a + b * n through the mean times of the sizes seen, b >= 0."""
    w = {n: min(count, 10) for n, (_, count) in seen.items()}
    total = sum(w.values())
    n_mean = sum(w[n] * n for n in w) / total
    t_mean = sum(w[n] * t for n, (t, _) in seen.items()) / total
    var = sum(w[n] * (n - n_mean) ** 2 for n in w)
    if var <= 0:
        return None
    cov = sum(w[n] * (n - n_mean) * (t - t_mean) for n, (t, _) in seen.items())
    b = max(0.0, cov / var)
    return t_mean - b * n_mean, b


class Rate:
    """A hit rate from a prior and recent evidence (older evidence decays)."""

    def __init__(self, prior: float, weight: float, decay: float) -> None:
        self.hits, self.trials, self.decay = prior * weight, weight, decay

    def update(self, hits: int, trials: int) -> None:
        self.hits = self.hits * self.decay + hits
        self.trials = self.trials * self.decay + trials

    def take_back(self, misses: float) -> None:
        """Count `misses` of those seen as hits after all."""
        self.hits = min(self.trials, self.hits + misses)

    @property
    def value(self) -> float:
        return min(self.hits / self.trials, 0.999)


class Acceptance:
    """A sequence's chance that drafted tokens are right: from its drafts verified, and from
    its proposals compared with the tokens decoded without them (which cost nothing, so a
    sequence that stopped drafting can tell when drafting would pay again). Recent evidence
    weighs most.

    Two rates for drafts guessed from an n-gram, because misses come in runs: the chance
    that a window's first draft token is right (`first`), and that a draft token is right
    after a right one (`then`); a long draft pays where a rate per token would have cut it
    short. A draft that goes on copying the text the sequence follows (the drafter's cursor,
    `copying`) is right as often as the copy goes on: `follow`, the drafter's own count over
    every token it followed (`SuffixDrafter.follow`), drafted or not, for its first token and
    each after it; its windows' verdicts are among those tokens and add nothing to the rest."""

    def __init__(
        self,
        prior: float = 0.7,
        *,
        weight: float = 2.0,
        decay: float = 0.9,
        follow: Rate | None = None,
    ) -> None:
        self.first = Rate(prior, weight, decay)
        self.then = Rate(prior, weight, decay)
        self.follow = follow or Rate(FOLLOW_PRIOR, FOLLOW_WEIGHT, FOLLOW_DECAY)

    def update(self, hits: int, trials: int, *, run: bool = False, copying: bool = False) -> None:
        """A window whose first `hits` draft tokens were right, of `trials` judged (one more
        than `hits` where a wrong one ended it). With `run`, its first token followed a
        right one (a window sent before the verdict on the one before it). `copying`: its
        draft came from the text the sequence was copying (counted by `follow` already)."""
        if trials < 1 or copying:
            return
        if run:
            self.then.update(hits, trials)
            return
        self.first.update(hits >= 1, 1)
        if hits >= 1:
            self.then.update(hits - 1, trials - 1)

    def then_seen(self, right: bool) -> None:
        """A token that was proposed but not drafted, after drafted ones that were all
        right, would have been `right` (a short window would else never tell `then`)."""
        self.then.update(int(right), 1)

    @property
    def rate(self) -> float:
        """The chance of the next draft token being right, at a window's start."""
        return self.first.value

    def _rates(self, copying: bool) -> tuple[float, float]:
        if copying:
            return self.follow.value, self.follow.value
        return self.first.value, self.then.value

    def reach(self, n: int, *, copying: bool = False) -> float:
        """The chance that the next n draft tokens are all right."""
        first, then = self._rates(copying)
        return 1.0 if n < 1 else first * then ** (n - 1)

    def expected(self, k: int, *, copying: bool = False) -> float:
        """The tokens a window of k draft tokens yields on average: the right ones up to the
        first wrong one, and the model's own token after them."""
        f, c = self._rates(copying)
        return 1 + f * (1 - c**k) / (1 - c)


def best_draft(
    acc: Acceptance,
    cost: WindowCost,
    room: int,
    *,
    margin: float = 1.05,
    copying: bool = False,
    extra: float = 0.0,
    overhead: float = 0.0,
) -> int:
    """How many draft tokens make a step yield the most tokens per unit of its time (a draft
    is kept up to its first wrong token, plus the model's own token there); 0 when no draft
    beats plain decoding by `margin`. `copying`: the draft goes on copying the text the
    sequence follows; `extra`: what proposing each draft token costs, in one-token steps (a
    draft model's forward pass; nothing for drafts from the text); `overhead`: what
    proposing a window costs besides (a draft model's forward passes beyond one a token)."""
    best_k, best = 0, margin
    for k in range(1, room + 1):
        gain = draft_gain(acc, cost, k, extra, copying=copying, overhead=overhead)
        if gain > best:
            best_k, best = k, gain
    return best_k


def draft_gain(
    acc: Acceptance,
    cost: WindowCost,
    k: int,
    extra: float = 0.0,
    *,
    copying: bool = False,
    overhead: float = 0.0,
) -> float:
    """Tokens per unit of a one-token step's time that a window of `k` drafts yields
    (`best_draft`): 1 for plain decoding."""
    return acc.expected(k, copying=copying) / (cost.cost(k + 1) + extra * k + overhead)


def follow_up_draft(
    acc: Acceptance,
    cost: WindowCost,
    ahead: int,
    proposal: Sequence[int],
    *,
    margin: float = 1.05,
    copying: bool = False,
    extra: float = 0.0,
) -> int | None:
    """How many draft tokens a window sent before the verdict on those in flight should hold
    after its guess (the proposal's first token), or None to send none. `ahead`: the tokens
    in flight not yet verified. Each token of such a window costs a window's extra compute
    (`cost.slope` of a step) and saves a trip only where every token before it was right; it
    is sent while that expected saving beats what the sequence makes per step without it
    (the best plain window's yield). `extra`: what proposing a token costs (`best_draft`;
    a split's entry, which sends these, counts no `overhead`: `DraftPolicy.model_overhead`)."""
    per_token = max(cost.slope, 0.02) + extra  # never free: the stages compute it
    serial = max(
        margin,
        *(draft_gain(acc, cost, k, extra, copying=copying) for k in range(MAX_DRAFT + 1)),
    )
    count = 0
    reach = acc.reach
    while count < len(proposal) and reach(ahead + 1 + count, copying=copying) / per_token > serial:
        count += 1
    return count - 1 if count else None
