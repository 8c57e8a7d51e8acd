"""What the scheduler and its executors say to each other (`serving/scheduler.py`): the
`Step` to run, with the items, slots and prefix-cache entries it touches, and the `Event`s a
step's tokens turn into."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.errors import MeshError
from meshagent.serving.sampling import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class StepItem:
    """Tokens of one sequence to run at positions pos..pos+len(tokens)-1."""

    seq: int
    slot: int
    pos: int
    tokens: tuple[int, ...]
    last: bool  # the sequence's pending input ends here: a token is wanted after it
    draft: int = 0  # the last `draft` tokens are a draft: logits are wanted for each
    # A window that follows one still in flight: its first token is a draft too, a guess at
    # the token that window ends with (so logits are wanted after each of its tokens).
    follows: bool = False


@dataclass(frozen=True)
class Opened:
    """A sequence got a slot and appears in steps from now on. `history`: the tokens a
    replayed completion had generated before (its sampler continues from them)."""

    seq: int
    slot: int
    sampling: SamplingParams
    history: tuple[int, ...] = ()
    # (entry, n): load a kept entry's KV into the slot and keep its first n positions.
    restore: tuple[int, int] | None = None


@dataclass(frozen=True)
class Save:
    """Keep the KV of the first `tokens` positions of `slot` as prefix-cache `entry`."""

    slot: int
    entry: int
    tokens: int


@dataclass(frozen=True)
class Step:
    """One batch to run. `saves` are kept first, then `released` slots are forgotten (their
    KV cleared), `opened` sequences are introduced, and the `dropped` prefix-cache entries
    freed, before `items` run."""

    items: tuple[StepItem, ...]
    opened: tuple[Opened, ...] = ()
    released: tuple[int, ...] = ()
    saves: tuple[Save, ...] = ()
    dropped: tuple[int, ...] = ()


@dataclass(frozen=True)
class Token:
    """A sequence produced `token`; `finish` says it ended with it ("stop": an end of
    generation token, which is not part of the text; "length": it reached its limit)."""

    seq: int
    token: int
    finish: str | None = None
    timing: tuple[float, ...] = ()  # a split's time per stage on the step that made it
    drafted: int = 0  # on the token that ends a window: the draft's length...
    accepted: int = 0  # ...and how many of its tokens were right
    windows: int = 0  # ...and how many windows of the sequence were in flight, itself included
    cached: int = 0  # on a sequence's first token: the prompt tokens a kept prefix gave it
    logprob: TokenLogprob | None = None  # where the request asked for log-probabilities


@dataclass(frozen=True)
class Failed:
    seq: int
    error: MeshError


Event = Token | Failed
