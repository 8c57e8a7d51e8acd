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
    """One batch to run. The `dropped` prefix-cache entries no restore or save of this step
    names are freed first (`drops`), then `saves` are kept, `released` slots are forgotten
    (their KV cleared), `opened` sequences are introduced, and the rest of `dropped` freed,
    before `items` run: the kept bytes never exceed the budget."""

    items: tuple[StepItem, ...]
    opened: tuple[Opened, ...] = ()
    released: tuple[int, ...] = ()
    saves: tuple[Save, ...] = ()
    dropped: tuple[int, ...] = ()

    def drops(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`dropped` as (those freed first, those freed after this step's restores and
        saves, which name them)."""
        held = {op.restore[0] for op in self.opened if op.restore} | {s.entry for s in self.saves}
        return (
            tuple(e for e in self.dropped if e not in held),
            tuple(e for e in self.dropped if e in held),
        )


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
    model: bool = False  # on the token that ends a window: its draft was the draft model's


@dataclass(frozen=True)
class Failed:
    seq: int
    error: MeshError


Event = Token | Failed
