"""When a speculating sequence drafts, how many tokens, and whether a window may follow one
still in flight: the scheduler's drafting policy, beside it rather than inside it.

A sequence submitted with `speculation` "on" or "auto" sends a draft after its last token when
its own text proposes one (`SuffixDrafter`, `serving/drafting.py`): the step's item holds the
token and the draft, the two a *window*, and the executor returns the tokens plain decoding
would have made from it, one to len(draft) + 1 of them (`drafting.verify`). The policy knows
the draft, so it reads the window's end from the tokens themselves: the first that differs
from the draft, or the one after it (`judge`). The executor keeps the accepted positions of
its cache and drops the rest.

- "on": the draft's length follows its acceptance (`DraftLength`).
- "auto": as many tokens as make a step yield the most tokens per unit of its time, or none
  (`best_draft`): the drafts' acceptance (`Acceptance`: for a copy, how often it goes on,
  which its drafter counts on every token; else of an n-gram window's first token and of one
  after a right one, fed also by proposals it did not send) against what a window costs next
  to one token's step (`WindowCost`, learnt from the decode steps the runner times,
  `observe`, or in a split from each window's trip, from `next_step` to its last token).
- With `max_windows` > 1 (a split's entry, whose tokens come back a trip later), a busy
  sequence may send its next window before the verdict on those in flight (`follow_up`).

A plain object, no I/O: the scheduler asks it and keeps the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshagent.serving.copying import TokenNames
from meshagent.serving.draft_model import DraftModel
from meshagent.serving.drafting import (
    MAX_DRAFT,
    Acceptance,
    DraftLength,
    Rate,
    SuffixDrafter,
    WindowCost,
    best_draft,
    draft_gain,
    follow_up_draft,
)
from meshagent.serving.model_drafts import Key, ModelDrafts
from meshagent.serving.sequence import DraftState, SeqState, Window

SPECULATION = ("auto", "on", "off")
# "auto" with a draft model whose drafts would not pay for its compute: a sequence asks it
# for a short proposal only every PROBE_EVERY steps, whose tokens are checked against those
# decoded instead (the acceptance it learns from); each probe that finds them still not
# paying doubles the wait, up to PROBE_MOST steps. A poor or dear draft model then costs a
# few of its forward passes per hundred steps rather than one per token.
PROBE_EVERY, PROBE_MOST, PROBE_TOKENS = 16, 256, 4
# A sequence asks the draft model nothing before it has decoded this many tokens ("auto"),
# unless the model already holds its text (a split's entry has it read the prompt while the
# prompt travels the stages): most answers that copy their prompt start copying within a
# few tokens, and one that does never pays the draft model's prefill of its prompt.
MODEL_AFTER = 8
# The model holds a sequence's text when it lacks no more than this many of its tokens (one
# proposal's reading of them costs about a forward pass).
_HOLDS_TEXT = 8
# What the draft model reads of a prompt at a time while it travels a split's stages, before
# its reading was timed (after: what it reads in the trip's time).
_PROMPT_CHUNK = 32
# How often "auto" expects a draft model's tokens to be right before any evidence: below the
# text's prior, since a small model of another family (another tokenizer) is right less
# often than the text it copies.
MODEL_PRIOR = 0.5
# The same for a draft model with the target's own vocabulary, token for token: mostly the
# target's family (a smaller sibling, or the model itself), right far more often than a model
# across tokenizers. A dear one's drafts then pay at a split's entry before any evidence,
# where probes held to `PROBE_SHARE` would never afford its reading of the prompt.
MODEL_PRIOR_SAME_VOCAB = 0.8
# Once the draft model's tokens were judged this many times (decayed) over the sequences it
# drafted for, a new sequence starts from how often they were right where that beats the
# prior: a draft model right 99 times in 100 for this target then drafts full windows from a
# sequence's first, rather than lengthen them window by window from 0.8 again.
MODEL_LEARNT, _LEARNT_DECAY = 32, 0.995
# The draft model's time per forward pass is timed on proposals that fed it at most this
# many tokens (a sequence's first proposal prefills its whole prompt); what it takes a token
# it catches up on, on proposals that fed it more.
_TIMED_FEED = 8
# "auto": a draft model whose drafts do not pay may spend on a sequence's probes at most this
# share of the time the sequence has decoded (its catching up on the text included), so a
# dear draft model costs nothing worth counting; and drafts that pay are asked only where
# what the model must first catch up on (a sequence's first proposal prefills its prompt)
# costs at most half of what they are expected to save over the rest of the sequence.
PROBE_SHARE = 0.01
CATCH_UP_SHARE = 0.5
# What a token it catches up on costs the draft model, in its forward passes, before it was
# timed (a batch of tokens costs less than as many forward passes).
_FEED_PRIOR = 0.3


@dataclass
class DraftCounts:
    """Drafts verified since the model was loaded (`SchedulerStats`)."""

    windows: int = 0  # windows verified with a draft
    tokens: int = 0  # draft tokens sent in them (a follow-up's guess, and void windows', too)
    accepted: int = 0  # and of those, the ones that were right
    # Of those, the draft model's windows, their draft tokens and the right ones (void
    # windows' tokens not counted).
    model_windows: int = 0
    model_tokens: int = 0
    model_accepted: int = 0


@dataclass(frozen=True)
class Verdict:
    """One token of a window, against the window's draft."""

    at: int  # its place in the window (0: the first, which carries the step's timing)
    right: bool  # it is the draft's next token: more of the window is coming
    # The window's draft tokens, its guess included (once it closed, with those of the
    # windows it voided), and of those the ones right so far.
    drafted: int
    accepted: int
    windows: int = 0  # once it closed, with a draft: the windows in flight, itself included


class DraftPolicy:
    """Drafts for the scheduler's speculating sequences, and what their verdicts teach.
    `slot_ctx` and `is_end`: a draft never runs past a slot, nor a window past a drafted end
    of generation; `max_windows`: how many windows of one sequence an executor may hold in
    flight; `names`: the vocabulary's names, which let drafts follow renames
    (`serving/copying.py`)."""

    def __init__(
        self,
        *,
        slot_ctx: int,
        is_end: Callable[[int], bool],
        max_windows: int = 1,
        names: TokenNames | None = None,
        model: DraftModel | None = None,
    ) -> None:
        self.slot_ctx = slot_ctx
        self.model = model  # a draft model beside the text's drafts (`serving/model_drafts.py`)
        self.max_windows = max(1, max_windows)
        self._is_end = is_end
        self._names = names
        self.cost = WindowCost()  # a window against a step, for "auto" (`observe`)
        self.counts = DraftCounts()
        self.model_forward: float | None = None  # seconds, a moving mean (`model_timed`)
        # How often the draft model's tokens were right, over the sequences ("auto")
        self.model_right = Rate(0.0, 0.0, _LEARNT_DECAY)
        # Seconds a token the draft model reads takes, moving means: as a proposal's first
        # forward pass (`model_timed`), and read ahead of its proposals (`caught_up`), which
        # where it is read a few tokens a trip on the worker (no reader) takes about twice
        # as long a token as a prompt read in one batch (Qwen2.5-Coder-1.5B: 52 against 28 ms).
        self.model_feed: float | None = None
        self.ahead_feed: float | None = None
        # A thread of its own reads sequences' text into the draft model beside the steps
        # (a split's entry, `ModelRunner`): what a sequence's model lacks is read whole
        # there, and no proposal waits on more than a trip's reading.
        self.reads_apart = False

    def start(
        self,
        speculation: str,
        prompt: Sequence[int],
        history: Sequence[int],
        seq: int | None = None,
    ) -> DraftState | None:
        """The drafting state of sequence `seq` submitted with `speculation` ("auto", "on" or
        "off": None)."""
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be auto, on or off, not {speculation!r}")
        if speculation == "off":
            return None
        drafter: SuffixDrafter | ModelDrafts = SuffixDrafter.answering(prompt, history, self._names)
        if self.model is not None and seq is not None:
            drafter = ModelDrafts(self.model, seq, drafter)
        if speculation == "auto":
            if isinstance(drafter, ModelDrafts):  # the model's drafts are judged apart
                prior = MODEL_PRIOR_SAME_VOCAB if drafter.model.same_vocab else MODEL_PRIOR
                if self.model_right.trials >= MODEL_LEARNT:  # (a poor record never lowers
                    prior = max(prior, self.model_right.value)  # it: drafts that went unsent
                    # would teach it nothing, and a sequence learns its own as it goes)
                drafter.accepts = Acceptance(prior, follow=drafter.follow)
                drafter.text_accepts = Acceptance(follow=drafter.follow)
                state = DraftState(drafter, acceptance=drafter.text_accepts)
            else:
                state = DraftState(drafter, acceptance=Acceptance(follow=drafter.follow))
        else:
            state = DraftState(drafter, length=DraftLength())
        if isinstance(drafter, ModelDrafts):
            state.model_held = drafter.held  # (what it need not read: `_behind`)
        return state

    def end(self, s: SeqState) -> None:
        """`s` ended: the draft model's slot, if it held one, is free."""
        if s.drafts is not None and isinstance(s.drafts.drafter, ModelDrafts):
            s.drafts.drafter.close()

    # ----- the draft model's proposals, computed outside the scheduler's lock -----

    def wanted(self, s: SeqState) -> tuple[int, tuple[int, ...], Key] | None:
        """What the draft model should propose for `s` before its next window: (at most
        how many tokens, after which tokens in flight, for which point), or None: none is
        wanted, or the one offered is for where `s` stands."""
        d = s.drafts
        if d is None or not isinstance(d.drafter, ModelDrafts) or s.cancelled:
            return None
        if s.busy:  # a window that would follow those in flight (a split's entry)
            if not s.windows or len(s.windows) >= self.max_windows:
                return None
            after = tuple(t for w in s.windows for t in w.ahead())
            k = MAX_DRAFT + 1
        elif len(s.pending) == 1 and s.n_past >= len(s.prompt):
            after, k = (), MAX_DRAFT
        else:
            return None
        self._judge_copy(d)
        if d.drafter.copy_goes:
            return None  # the text's draft goes while it copies: no model's is read
        if d.acceptance is not None and s.generated < MODEL_AFTER and _behind(d) > _HOLDS_TEXT:
            return None  # (an answer that copies its prompt is copying by then)
        if self.reads_apart and self._lacks_a_trip(s):
            return None  # (the reader reads it while the sequence's plain tokens go)
        k = self._model_k(s, k)
        if not k or len(d.drafter.offered(after)) >= max(1, k - 1):
            return None  # none wanted, or the one offered still goes as far
        return k, after, d.drafter.key(after)

    def _lacks_a_trip(self, s: SeqState) -> bool:
        """Whether reading what the draft model lacks of `s`'s text would take it longer
        than a trip (a one-token step), or it was never timed and lacks more than
        `_PROMPT_CHUNK` tokens."""
        d = s.drafts
        assert d is not None
        step = self.cost.step_seconds()
        if self.model_forward is None or step is None:
            return _behind(d) > _PROMPT_CHUNK
        return self.catch_up(s) > step

    def catch_up_wanted(self, s: SeqState, now: float | None = None) -> int:
        """How many tokens of its text the draft model should read for `s` now, proposing
        nothing (`DraftModel.catch_up`): where `s` has windows in flight (at a split's entry,
        its prompt's among them) and its drafts would pay but for what catching up costs.
        With a reader of its own (`reads_apart`), all it lacks, beyond `_HOLDS_TEXT`; else as
        many as it reads before the oldest is expected back (the thread that proposes idles
        meanwhile), and before its reading was timed, `_PROMPT_CHUNK` tokens of a prompt in
        flight. So its first drafts can go with its first tokens. Else 0. It reads while the
        text's copy goes too, though no proposal of its goes then: an answer that retells its
        prompt and then goes its own way finds the model holding the text where the copy
        ends, where catching up on all it skipped would cost more than its drafts save."""
        d = s.drafts
        if (
            d is None
            or not isinstance(d.drafter, ModelDrafts)
            or s.cancelled
            or not (s.busy and s.windows)
        ):
            return 0
        behind = _behind(d)
        if behind <= 0:
            return 0
        if d.drafter.accepts is None:  # "on": its proposals read what they lack, but where
            if not self.reads_apart:  # a reader of its own reads beside the steps
                return 0
        else:
            extra, overhead = self.model_extra(), self.model_overhead()
            acc = d.drafter.accepts
            if not best_draft(acc, self.cost, MAX_DRAFT, extra=extra, overhead=overhead):
                return 0
        if self.reads_apart:  # read beside the steps: no trip bounds it
            if behind <= _HOLDS_TEXT:
                return 0  # (its next proposal reads that much)
            d.model_reading = len(d.drafter.text.tokens)
            return behind
        if self.model_forward is None:
            return min(behind, _PROMPT_CHUNK) if not s.generated else 0
        feed = self.ahead_feed if self.ahead_feed is not None else self._feed_seconds()
        return min(behind, int(self._time_in_flight(s, now) / feed))

    def caught_up(self, s: SeqState, tokens: int, seconds: float) -> None:
        """The draft model read `tokens` more of `s`'s text in `seconds`."""
        d = s.drafts
        if d is None:
            return
        if tokens > 0:
            d.model_held += tokens
            d.model_spent += seconds
            self.ahead_feed = _moving(self.ahead_feed, seconds / tokens)
        if d.model_reading:  # a read of all it lacked: it holds the text as it stood then
            d.model_held = max(d.model_held, d.model_reading)
            d.model_reading = 0

    def _time_in_flight(self, s: SeqState, now: float | None) -> float:
        """Seconds until the oldest of `s`'s windows in flight is expected back (its whole
        trip where it was not timed)."""
        step = self.cost.step_seconds() or 0.0
        w = s.windows[0]
        left = step * self.cost.cost(len(w.draft) + 1)
        if now is not None and w.sent_at is not None:
            left -= now - w.sent_at
        return max(0.0, left)

    def _model_k(self, s: SeqState, most: int) -> int:
        """How many tokens to ask of the draft model for a sequence, at most `most`: with
        "auto", one beyond the draft that pays best for the model's cost (the last tells
        whether a longer one would have been right), where catching up costs less than they
        save; else none, but every `PROBE_EVERY` steps a short one within `PROBE_SHARE` of
        the sequence's time; with "on", its draft length's."""
        d = s.drafts
        assert d is not None and isinstance(d.drafter, ModelDrafts)
        d.drafter.asking = True
        if d.length is not None:
            return min(most, d.length.k + 1)
        assert d.drafter.accepts is not None
        extra, overhead = self.model_extra(), self.model_overhead()
        k = best_draft(d.drafter.accepts, self.cost, MAX_DRAFT, extra=extra, overhead=overhead)
        if k and self.model_forward is None:
            k = min(k, PROBE_TOKENS)  # (what a forward pass of it costs is not known yet)
        step = self.cost.step_seconds()
        catch_up = self.catch_up(s)
        if k and catch_up and step:
            gain = draft_gain(d.drafter.accepts, self.cost, k, extra, overhead=overhead)
            saving = max(0, s.limit - s.generated) * (1 - 1 / gain) * step
            if catch_up > CATCH_UP_SHARE * saving:
                k = 0  # (a probe within the sequence's share may still catch it up)
        if k:
            d.model_idle, d.model_every = 0, PROBE_EVERY
            return min(most, k + 1)
        d.drafter.asking = False
        d.model_idle += 1
        if d.model_idle < d.model_every:
            return 0
        if step and self.model_forward is not None:
            cost = catch_up + (PROBE_TOKENS + self._beyond()) * self.model_forward
            if d.model_spent + cost > PROBE_SHARE * s.generated * step:
                return 0  # (asked again at the next step: the share grows as it decodes)
        d.model_idle, d.model_every = 0, min(PROBE_MOST, 2 * d.model_every)
        return min(most, PROBE_TOKENS)

    def catch_up(self, s: SeqState) -> float:
        """What the draft model's next proposal for `s` would first spend feeding it the
        text it does not hold yet, in seconds (0 before its forward pass was timed)."""
        d = s.drafts
        if d is None or not isinstance(d.drafter, ModelDrafts) or self.model_forward is None:
            return 0.0
        return max(0, _behind(d)) * self._feed_seconds()

    def _feed_seconds(self) -> float:
        """What a token the draft model catches up on takes (its forward pass timed)."""
        assert self.model_forward is not None
        return self.model_feed if self.model_feed is not None else self.model_forward * _FEED_PRIOR

    def model_timed(self, forwards: int, fed: int, seconds: float) -> None:
        """A proposal of the draft model ran `forwards` forward passes, the first fed `fed`
        tokens, in `seconds`."""
        if forwards < 1 or seconds <= 0:
            return
        if fed > _TIMED_FEED:
            if self.model_forward is not None:  # (the other forward passes fed one token)
                per = max(0.0, seconds - (forwards - 1) * self.model_forward) / fed
                self.model_feed = _moving(self.model_feed, per)
            return
        self.model_forward = _moving(self.model_forward, seconds / forwards)

    def model_overhead(self) -> float:
        """What the draft model's proposing a window costs besides one forward pass a drafted
        token, in the target's one-token steps: it is asked for one token beyond the draft
        (`_model_k`), and across tokenizers decodes one more to cut at a boundary both
        agree on (`DraftModel.propose`). For a draft of one token, three forward passes
        where one was counted. None at a split's entry (`max_windows` > 1): there the model
        proposes a window while those before it travel, a trip many of its forward passes
        long, and those passes fall within it."""
        if self.max_windows > 1:
            return 0.0
        return self.model_extra() * (1 + self._beyond())

    def _beyond(self) -> int:
        """The forward passes a proposal runs beyond the tokens it is asked for: across
        tokenizers, one to cut at (`DraftModel.propose`)."""
        return int(self.model is not None and not self.model.same_vocab)

    def model_extra(self) -> float:
        """What the draft model's proposing one token costs, in the target's one-token
        steps (0 before both were timed)."""
        step = self.cost.step_seconds()
        if self.model_forward is None or not step:
            return 0.0
        return self.model_forward / step

    def offer(self, s: SeqState, key: Key, proposal: Sequence[int], seconds: float = 0.0) -> None:
        """The draft model proposed `proposal` for `s` at `key` (`wanted`) in `seconds`."""
        d = s.drafts
        if d is not None and isinstance(d.drafter, ModelDrafts):
            d.drafter.offer = (key, tuple(proposal))
            d.model_spent += seconds
            # It holds the text up to the key, the tokens in flight after it, and all but the
            # last it drafted: all of them once the target takes them (else a proposal reads
            # from where they part, a few tokens)
            d.model_held = max(d.model_held, key[0] + len(key[1]) + max(0, len(proposal) - 1))

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of decode tokens only (one per sequence, plus drafts) took `seconds`."""
        self.cost.observe(tokens, seconds)

    # ----- what to send -----

    def draft(self, s: SeqState, budget: int) -> tuple[int, ...]:
        """The draft to send after a decoding sequence's last token, within `budget` tokens,
        its limit and its slot: () where it drafts none, or with "auto" where none pays."""
        d = s.drafts
        if d is None:
            return ()
        most = d.length.k if d.length is not None else MAX_DRAFT
        room = min(most, budget, s.limit - s.generated - 1, self.slot_ctx - s.n_past - 1)
        # The drafter holds the prompt, the history and every token since: the pending one
        # is its last.
        self._judge_copy(d)
        proposal = d.drafter.propose(room) if room > 0 else ()
        d.copying = d.drafter.copying and not self._from_model(d)
        if d.acceptance is None or not proposal:
            return proposal
        model = self._from_model(d)
        acc = self._accepts(d, model)
        extra = self.model_extra() if model else 0.0
        overhead = self.model_overhead() if model else 0.0
        k = best_draft(
            acc, self.cost, len(proposal), copying=d.copying, extra=extra, overhead=overhead
        )
        if not k:  # it would not pay: see whether its tokens would have been right
            if not d.shadow and not d.copying:  # (a copy's tokens are counted as they come)
                d.shadow, d.shadow_after, d.shadow_model = proposal, False, model
            return ()
        d.shadow = ()
        if k < len(proposal) and not d.copying:  # (a copy's tokens are counted as they come)
            d.beyond, d.beyond_model = proposal[k], model
        return proposal[:k]

    def follow_up(self, s: SeqState, budget: int) -> tuple[int, ...]:
        """A window to send before the verdict on the busy sequence's windows in flight: it
        assumes every draft in flight is right, and its first token is the drafter's guess at
        the token the last one ends with (`StepItem.follows`), the rest its draft; () where
        none follows. A window never goes past a drafted end of generation nor, all counted,
        past the sequence's limit, so no token comes for a sequence after it ended."""
        d = s.drafts
        if d is None or len(s.windows) >= self.max_windows:
            return ()
        ahead = [t for w in s.windows for t in w.ahead()]
        if any(self._is_end(t) for t in ahead):
            return ()  # a drafted end of generation: nothing follows it
        if isinstance(d.drafter, ModelDrafts) and d.drafter.awaits(ahead):
            return ()  # the draft model's proposal for this point comes before the next step
        promised = sum(len(w.draft) + 1 for w in s.windows) - s.windows[0].at
        most = d.length.k if d.length is not None else MAX_DRAFT
        room = min(  # drafts after the guess
            most, budget - 1, s.limit - s.generated - promised - 1, self.slot_ctx - s.n_past - 2
        )
        self._judge_copy(d)
        proposal = d.drafter.propose(room + 1, ahead) if room >= 0 else ()
        ends = [i for i, t in enumerate(proposal) if self._is_end(t)]
        proposal = proposal[: ends[0] + 1] if ends else proposal
        if not proposal or self._is_end(proposal[0]):
            return ()
        if d.acceptance is not None:
            model = self._from_model(d)
            copying = s.windows[0].copying and not model
            extra = self.model_extra() if model else 0.0
            k = follow_up_draft(
                self._accepts(d, model), self.cost, len(ahead), proposal, copying=copying,
                extra=extra,
            )  # fmt: skip
            if k is None:
                return ()
            proposal = proposal[: k + 1]
        return proposal

    def _judge_copy(self, d: DraftState) -> None:
        """With "auto" and a draft model, tell its drafter whether a window of the text's
        copy pays now (`ModelDrafts.copy_pays`): where it does not, the model is asked."""
        if isinstance(d.drafter, ModelDrafts) and d.acceptance is not None and d.drafter.copying:
            d.drafter.copy_pays = bool(best_draft(d.acceptance, self.cost, MAX_DRAFT, copying=True))

    @staticmethod
    def _from_model(d: DraftState) -> bool:
        return isinstance(d.drafter, ModelDrafts) and d.drafter.from_model

    @staticmethod
    def _accepts(d: DraftState, model: bool) -> Acceptance:
        """The acceptance that judges a draft of the model's (`model`) or of the text's."""
        if model and isinstance(d.drafter, ModelDrafts) and d.drafter.accepts is not None:
            return d.drafter.accepts
        assert d.acceptance is not None
        return d.acceptance

    def from_model(self, s: SeqState) -> bool:
        """Whether the last draft proposed for `s` was the draft model's."""
        return s.drafts is not None and self._from_model(s.drafts)

    # ----- what comes back -----

    def judge(self, w: Window, token: int) -> Verdict:
        """`token`, the next to come back of window `w`, against its draft (and counted)."""
        at, window = w.at, w.draft
        w.at += 1
        right = at < len(window) and token == window[at]
        guessed = w.guess is not None  # and right, or its window would have been void
        c = self.counts
        if at == 0 and (window or guessed):
            c.windows += 1
            c.tokens += len(window) + guessed
            c.accepted += guessed
            if w.model:
                c.model_windows += 1
                c.model_tokens += len(window) + guessed
                c.model_accepted += guessed
        c.accepted += right
        c.model_accepted += right and w.model
        return Verdict(at, right, len(window) + guessed, at + right + guessed)

    def closed(
        self,
        s: SeqState,
        w: Window,
        verdict: Verdict,
        token: int,
        *,
        void: int,
        now: float | None,
    ) -> None:
        """Window `w` of `s` ended with `token` (out of `s.windows`, those after it still
        there), voiding `void` draft tokens of the windows after it: what it tells of drafts'
        acceptance and, timed from `next_step` to `now`, of a window's cost."""
        self.counts.tokens += void
        d = s.drafts
        if d is not None and d.beyond is not None:
            # Every drafted token was right and no window follows: the model's own token
            # here says whether the next proposed one would have been right too.
            if verdict.at == len(w.draft) and not s.windows and d.acceptance is not None:
                self._accepts(d, d.beyond_model).then_seen(token == d.beyond)
            d.beyond = None
        if now is not None and w.sent_at is not None:
            self.cost.observe(len(w.draft) + 1, now - w.sent_at)
        drafted, accepted = verdict.drafted, verdict.accepted
        if d is None or not drafted:
            return
        if d.length is not None:
            d.length.update(drafted, accepted)
        if d.acceptance is not None:
            judged = accepted + (accepted < drafted)
            acc = self._accepts(d, w.model)
            acc.update(accepted, judged, run=w.guess is not None, copying=w.copying)
            if w.model:
                self.model_right.update(accepted, judged)

    def read(self, s: SeqState, token: int) -> None:
        """A token of `s` that it goes on after: its drafter reads it, and a proposal "auto"
        did not send is checked against it."""
        d = s.drafts
        if d is None:
            return
        d.drafter.extend((token,))
        if d.shadow and d.acceptance is not None:
            hit = token == d.shadow[0]
            acc = self._accepts(d, d.shadow_model)
            if d.shadow_after:
                acc.then_seen(hit)
            else:
                acc.update(hit, 1)
            if d.shadow_model:
                self.model_right.update(hit, 1)
            d.shadow, d.shadow_after = (d.shadow[1:] if hit else ()), True


def _moving(was: float | None, now: float) -> float:
    """A moving mean of seconds that was `was` (None: none yet), after `now`."""
    return now if was is None else was + 0.2 * (now - was)


def _behind(d: DraftState) -> int:
    """How many of the sequence's tokens its draft model does not hold yet (as its last
    proposal or catch-up left it)."""
    assert isinstance(d.drafter, ModelDrafts)
    return len(d.drafter.text.tokens) - d.model_held
