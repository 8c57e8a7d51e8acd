"""What the scheduler (`serving/scheduler.py`) keeps of each sequence: its input, its slot,
its place in the queue and in the steps in flight, its drafting state, and the decode windows
it has in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshagent.serving.drafting import Acceptance, DraftLength, SuffixDrafter

if TYPE_CHECKING:
    from meshagent.serving.model_drafts import ModelDrafts
from meshagent.serving.sampling import SamplingParams


@dataclass
class SeqState:
    id: int
    prompt: tuple[int, ...]  # prefilled in chunks; any history follows one token per step
    limit: int
    sampling: SamplingParams
    history: tuple[int, ...] = ()
    slot: int | None = None
    pending: list[int] = field(default_factory=list)
    n_past: int = 0
    generated: int = 0
    busy: bool = False  # all its input is in a step; its token is not back yet
    busy_in: int = -1  # the step that made it busy
    cancelled: bool = False
    ready_since: int = 0  # the step count when its pending input arrived
    drafts: DraftState | None = None  # speculating: what it drafts from, and its record
    windows: deque[Window] = field(default_factory=deque)  # in flight, oldest first
    # Windows it voided may still be in flight ahead of its next step, which would queue
    # behind them: that step's trip is not what its window costs, and is not timed.
    behind_void: bool = False
    cache: bool = False  # may start from a kept prefix, and leaves its own
    tokens: list[int] = field(default_factory=list)  # prompt, history, tokens since
    cached: int = 0  # its input's positions a kept prefix gave it
    announced: bool = False  # its first token went out (with `cached`)
    waiting: bool = False  # for another's prompt to run, to start from its KV (`submit`)
    followers: list[SeqState] = field(default_factory=list)  # those waiting for its prompt


@dataclass
class DraftState:
    """A speculating sequence's drafting state, which the drafting policy
    (`serving/draft_policy.py`) reads and keeps."""

    drafter: SuffixDrafter | ModelDrafts  # its text so far, indexed (and a draft model's)
    length: DraftLength | None = None  # "on": how many tokens to draft
    acceptance: Acceptance | None = None  # "auto": how often its drafts are right
    # "auto", not drafting a guess from an n-gram: what it would have drafted, checked
    # against the tokens decoded instead (evidence for `Acceptance.first`, then, while right,
    # for `Acceptance.then`; a copy's tokens are counted by its drafter as they come)
    shadow: tuple[int, ...] = ()
    shadow_after: bool = False  # the shadow's next token follows a right one
    shadow_model: bool = False  # the shadow was the draft model's proposal
    copying: bool = False  # its last proposal went on copying the text it follows
    # "auto", drafting fewer n-gram tokens than proposed: the first it left out, to see whether
    # it would have been right after the drafted ones (evidence for `Acceptance.then` that a
    # short window gives no other way)
    beyond: int | None = None
    beyond_model: bool = False  # that proposal was the draft model's
    # "auto" with a draft model whose drafts do not pay: the steps since it last proposed,
    # and how many it waits between proposals (from `PROBE_EVERY`, doubling after each that
    # found them still not paying), so the sequence learns when they would pay again
    model_idle: int = 0
    model_every: int = 16
    # What the draft model computed for this sequence (seconds, its proposals' catching up
    # included) and how much of the sequence's text it held at its last proposal: what a
    # proposal now would first feed it (`DraftPolicy.catch_up`)
    model_spent: float = 0.0
    model_held: int = 0
    # A read of all it lacked, handed to a split's entry's reader: the sequence's length
    # then, which it holds once the read is done (`DraftPolicy.caught_up`); 0: none.
    model_reading: int = 0


@dataclass
class Window:
    """A decode step in flight: its first token at `pos` (the sequence's last token, or for a
    window that follows another, the `guess` at that one's last), then `draft`."""

    pos: int
    draft: tuple[int, ...]
    guess: int | None = None
    sent_at: float | None = None  # when the step was taken; None: not timed
    at: int = 0  # the index in the draft of the next token to come back
    copying: bool = False  # its draft went on copying the text the sequence follows
    model: bool = False  # its draft was the draft model's
    stood: bool = False  # its guess was right: the window before it ended with that token

    def ahead(self) -> list[int]:
        """Its tokens not yet verified, in order (a guess that stood is in the text)."""
        guess = () if self.guess is None or self.stood else (self.guess,)
        return [*guess, *self.draft[self.at :]]
