"""Which sequences run next, and in what share: a sans-IO scheduler.

A plain object with no I/O and no threads: callers feed it events (a sequence is submitted, a
step is taken, a token is ready, a sequence is cancelled or fails) and it answers with the
next `Step` to run and the `Event`s to deliver. Executors (a local llama.cpp context, the
entry of a split) run the steps; `ModelRunner` guards the scheduler with a lock and moves the
events to the requests.

Policy:
- Slots go first come, first served; past the slots, a FIFO queue bounded by `max_queue`.
- A step packs one decode token per decoding sequence and chunks of prompts, within
  `max_batch_tokens`; decode tokens are given budget first, so a long prompt never stalls the
  sequences that are decoding.
- A sequence that has waited longest to run is considered first, so none starves.
- With a pipeline of `depth` stages a step takes at most 1/depth of the active sequences
  (at least one), so that at least `depth` groups are in flight and no stage waits for work.
- A sequence whose input is all in a step is *busy* until its token is ready. A cancelled
  sequence frees its slot at once; a busy one frees it when its step's token comes back (a
  slot reused earlier could be handed the old sequence's token).
- A replayed sequence (`history`: the tokens it had generated before its chain broke) runs
  its prompt as before, then its history one token per step, as those tokens first ran, and
  wants a token only after the last. Those steps need no token back, so they follow each
  other into a pipeline without waiting; and since every token runs in a batch of the shape
  it first ran in, an engine whose results depend on the batch shape (llama.cpp's do, in the
  last bits) computes the same cache, and a seeded sampler draws the same next token.
- A speculating sequence (`speculation` "on" or "auto") sends a draft after its last token
  when its own text proposes one (`serving/drafting.py`): the step's item holds the token and
  the draft, and the executor returns the tokens plain decoding would have made from that
  window, one to len(draft) + 1 of them (`verify`). The scheduler knows the draft, so it
  reads the window's end from the tokens themselves: the first that differs from the draft,
  or the one after it. The executor keeps the accepted positions of its cache and drops the
  rest. Drafts take budget after the decode tokens and at most half of it, so prompts keep
  moving. With "on", the draft's length follows its acceptance (`DraftLength`). With "auto",
  a sequence drafts as many tokens as make a step yield the most tokens per unit of its
  time, or none: its drafts' acceptance (`Acceptance`: for a copy, how often it goes on, which
  its drafter counts on every token; else of an n-gram window's first token and of one after a
  right one, fed also by proposals it did not send) against what a window costs next to one
  token's step (`WindowCost`, learnt from the decode steps the runner times, `observe`, or in
  a split from each window's trip, from `next_step` to its last token, both given a `now`).
- With `max_windows` > 1 (a split's entry, whose tokens come back a trip later), a busy
  sequence may send its next window before the verdict on those in flight: it assumes every
  draft in flight is right, and the window's first token is its drafter's guess at the token
  the last one ends with (`StepItem.follows`). When a window's verdict differs (a draft
  rejected, or its last token not the guess), the windows after it are void: the scheduler
  forgets them, and the last stage, which knows the same, samples nothing for them. Windows
  never go past a drafted end of generation nor, all counted, past the sequence's limit, so
  no token comes for a sequence after it ended.
- With a `PrefixIndex` (`serving/prefix_cache.py`), a sequence that may reuse cached prefixes
  (`submit(cache=True)`) starts from the longest prefix of its input that an entry holds:
  `Opened.restore` tells the executor to load that entry's KV into the slot and cut it to the
  shared length, and only the rest is prefilled. A sequence that ends (not one that failed)
  leaves the KV of the tokens its slot holds as an entry (`Step.saves`, before the slot is
  cleared); one cancelled with a step in flight (a stop string) leaves, at once, the tokens
  its slot holds whatever that step's verdict, so that a request sent right after it finds
  them. Entries the index evicts are in `Step.dropped`, after the step's restores.
- Sequences that share a prompt (`n` completions of one request) are prefilled once: one
  submitted `after` another waits in the queue until that one's prompt has all run, which then
  keeps its prompt's KV as an entry (a `Save` of a live slot, before its first decode token
  runs) for the waiting ones to start from. Without an index, or when the one they wait for
  ends first, they prefill as any other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshagent.errors import ContextOverflow, MeshError, QueueFull, ShuttingDown
from meshagent.serving.copying import TokenNames
from meshagent.serving.drafting import (
    MAX_DRAFT,
    Acceptance,
    DraftLength,
    SuffixDrafter,
    WindowCost,
    best_draft,
    follow_up_draft,
)
from meshagent.serving.prefix_cache import PrefixIndex
from meshagent.serving.sampling import SamplingParams, TokenLogprob
from meshagent.serving.sequence import SeqState, Window
from meshagent.serving.steps import Event, Failed, Opened, Save, Step, StepItem, Token


@dataclass
class SchedulerStats:
    active: int
    queued: int
    slots: int
    max_queue: int
    tokens_processed: int
    batches: int
    draft_windows: int = 0  # windows verified with a draft, since the model was loaded
    draft_tokens: int = 0  # draft tokens sent in them
    draft_accepted: int = 0  # and of those, the ones that were right
    prefix_entries: int = 0  # kept prefixes (`PrefixIndex`), their bytes, and lookups
    prefix_bytes: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prefix_tokens: int = 0  # prompt tokens the hits did not prefill


class Scheduler:
    def __init__(
        self,
        *,
        n_slots: int,
        slot_ctx: int,
        max_queue: int,
        is_end: Callable[[int], bool],
        max_batch_tokens: int = 512,
        depth: int = 1,
        max_windows: int = 1,
        prefix: PrefixIndex | None = None,
        token_name: TokenNames | None = None,  # (`serving/copying.py`)
    ) -> None:
        if max_batch_tokens <= n_slots:
            raise ValueError("the token budget of a step must exceed the number of slots")
        self.n_slots = n_slots
        self.slot_ctx = slot_ctx
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.depth = max(1, depth)
        # Windows of one sequence in flight at once: more than one only where an executor
        # sends a window before the verdict on the last comes back (a split's entry).
        self.max_windows = max(1, max_windows)
        self._is_end = is_end
        self._token_name = token_name  # tokens' text and names (drafts' renames, blocks)
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._queue: deque[SeqState] = deque()
        self._by_slot: dict[int, SeqState] = {}
        self._by_id: dict[int, SeqState] = {}
        self._opened: list[Opened] = []
        self._released: list[int] = []
        self._saves: list[Save] = []
        self._dropped: list[int] = []
        # Kept prefixes, where the executor can restore them (see the module's docstring).
        self.prefix = prefix
        self._prefix_tokens = 0
        self._steps = 0
        self._tokens = 0
        self._drafts = [0, 0, 0]  # windows, tokens drafted, tokens accepted
        self.window_cost = WindowCost()  # a window against a step, for "auto" (`observe`)
        self.closed = False

    # ----- what callers ask -----

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            active=len(self._by_slot),
            queued=len(self._queue),
            slots=self.n_slots,
            max_queue=self.max_queue,
            tokens_processed=self._tokens,
            batches=self._steps,
            draft_windows=self._drafts[0],
            draft_tokens=self._drafts[1],
            draft_accepted=self._drafts[2],
            prefix_entries=len(self.prefix) if self.prefix else 0,
            prefix_bytes=self.prefix.used if self.prefix else 0,
            prefix_hits=self.prefix.hits if self.prefix else 0,
            prefix_misses=self.prefix.misses if self.prefix else 0,
            prefix_tokens=self._prefix_tokens,
        )

    def slot_of(self, seq: int) -> int | None:
        s = self._by_id.get(seq)
        return None if s is None else s.slot

    def seq_in(self, slot: int) -> int | None:
        s = self._by_slot.get(slot)
        return None if s is None else s.id

    def any_busy(self) -> bool:
        """Some live sequence waits for the token of a step it is in."""
        return any(s.busy and not s.cancelled for s in self._by_slot.values())

    def steps_in_flight(self) -> int:
        return len({s.busy_in for s in self._by_slot.values() if s.busy})

    # ----- events in -----

    def submit(
        self,
        seq: int,
        prompt: tuple[int, ...],
        limit: int,
        sampling: SamplingParams,
        history: tuple[int, ...] = (),
        *,
        speculation: str = "off",
        cache: bool = False,
        after: int | None = None,
    ):
        """A new request: it takes a free slot, or waits in the queue. `history`: a replayed
        completion's tokens so far, run after the prompt one per step; `limit` counts the
        tokens still to generate; `speculation`: "on" or "auto" to send drafts (see the
        module's docstring), "off" not to; `after`: a sequence with the same prompt, whose
        prefill this one waits for and starts from (where prefixes are kept).
        Raises ShuttingDown after `close`, QueueFull when the queue is at its bound,
        ContextOverflow when the prompt, history and `limit` new tokens do not fit a slot."""
        if self.closed:
            raise ShuttingDown("the agent is shutting down and takes no new requests")
        if not prompt or limit < 1:
            raise ValueError("a sequence needs a prompt and room for one token")
        held = len(prompt) + len(history)
        if held + limit > self.slot_ctx:
            raise ContextOverflow(
                f"sequence needs {held + limit} tokens of context, the slot holds {self.slot_ctx}",
                prompt_tokens=held,
                limit=self.slot_ctx,
            )
        if not self._free and len(self._queue) >= self.max_queue:
            raise QueueFull(
                f"all {self.n_slots} slots are busy and {len(self._queue)} requests "
                "are queued; retry shortly"
            )
        s = SeqState(seq, tuple(prompt), limit, sampling, tuple(history))
        s.cache = cache and self.prefix is not None
        s.tokens = [*prompt, *history]
        if speculation not in ("auto", "on", "off"):
            raise ValueError(f"speculation must be auto, on or off, not {speculation!r}")
        if speculation != "off":
            s.drafter = SuffixDrafter.answering(prompt, history, self._token_name)
            if speculation == "auto":
                s.acceptance = Acceptance(follow=s.drafter.follow)
            else:
                s.length = DraftLength()
        leader = self._by_id.get(after) if after is not None else None
        if (
            s.cache
            and not history
            and leader is not None
            and leader.prompt == s.prompt
            and not leader.history
            # its first token has not run yet: its slot holds the prompt and no more
            and leader.n_past <= len(leader.prompt)
            and not leader.cancelled
        ):
            s.waiting = True
            leader.followers.append(s)
        self._by_id[seq] = s
        self._queue.append(s)
        self._admit()

    def cancel(self, seq: int) -> None:
        """The request is gone: it leaves the queue, or frees its slot (a busy sequence when
        its token comes back). Unknown or finished sequences are ignored."""
        s = self._by_id.get(seq)
        if s is None:
            return
        if s.slot is None:
            self._queue.remove(s)
            del self._by_id[seq]
            self._unblock(s)
        elif s.busy:
            s.cancelled = True
            self._keep_settled(s)
        else:
            self._release(s)

    def _keep_settled(self, s: SeqState) -> None:
        """A sequence cancelled with a step in flight (a stop string found in its text) keeps
        the prefix its slot will hold whatever the step's verdict, now rather than when its
        token comes back: a request sent right after it (the conversation's next turn) finds
        it. Its tokens so far end with the first token of its oldest window in flight and
        the drafts of it already verified: those stay in the cache, the window's later
        drafts may not. The save runs at the next step, after the one in flight, and its
        release later keeps nothing more."""
        if not (s.cache and self.prefix is not None):
            return
        assert s.slot is not None
        self._keep(s.slot, s.tokens)
        s.cache = False

    def next_step(self, now: float | None = None) -> Step | None:
        """The next batch to run, or None when no sequence has input to run. `now` (any
        clock): when it is taken, to time the trips of the windows whose tokens come back
        through `token` with a `now` too (a split's)."""
        self._share_prompts()
        ready = [s for s in self._by_slot.values() if s.pending and not s.cancelled]
        ready.sort(key=lambda s: (s.ready_since, s.id))
        active = sum(1 for s in self._by_slot.values() if not s.cancelled)
        share = ready[: max(1, active // self.depth)]
        budget = self.max_batch_tokens
        takes: dict[int, int] = {}
        for s in share:  # decode (and replayed) tokens first
            if s.n_past >= len(s.prompt):
                takes[s.id] = 1
                budget -= 1
        drafts: dict[int, tuple[int, ...]] = {}
        draft_budget = budget // 2
        for s in share:  # then drafts, within half of what is left
            if takes.get(s.id) == 1 and len(s.pending) == 1 and s.drafter is not None:
                draft = self._draft(s, draft_budget)
                if draft:
                    drafts[s.id] = draft
                    draft_budget -= len(draft)
                    budget -= len(draft)
        for s in share:  # prompt chunks, never past the prompt's end
            if s.id not in takes and budget > 0:
                takes[s.id] = min(len(s.prompt) - s.n_past, budget)
                budget -= takes[s.id]
        items = []
        for s in share:
            take = takes.get(s.id, 0)
            if take == 0:
                continue
            assert s.slot is not None
            draft = drafts.get(s.id, ())
            tokens = (*s.pending[:take], *draft)
            del s.pending[:take]
            last = not s.pending
            items.append(StepItem(s.id, s.slot, s.n_past, tokens, last, len(draft)))
            if last:  # a decode step's trip is timed
                sent_at = now if take == 1 and not s.behind_void else None
                w = Window(s.n_past + take - 1, draft, sent_at=sent_at)
                w.copying = s.copying and bool(draft)
                s.windows.append(w)
                s.behind_void = False
            s.n_past += len(tokens)
            s.busy = last
            s.busy_in = self._steps
            s.ready_since = self._steps + 1  # a prompt's next chunk waits behind the others
            self._tokens += len(tokens)
        if self.max_windows > 1:
            ran = {it.seq for it in items}  # (a window is not followed in its own step)
            items += self._follow_ups(min(draft_budget, budget), ran)
        if not items and not self._released and not self._saves:
            return None
        return self._take_step(tuple(items))

    def _follow_ups(self, budget: int, ran: set[int]) -> list[StepItem]:
        """Windows sent before the verdict on the windows in flight, assuming they are all
        accepted: each starts with the token its drafter guesses the last one ends with.
        A rejection makes them void, here and at the last stage alike (see `token`)."""
        items = []
        busy = [s for s in self._by_slot.values() if s.busy and not s.cancelled and s.windows]
        for s in sorted(busy, key=lambda s: (s.ready_since, s.id)):
            if s.drafter is None or len(s.windows) >= self.max_windows or s.id in ran:
                continue
            ahead = [t for w in s.windows for t in w.ahead()]
            if any(self._is_end(t) for t in ahead):
                continue  # a drafted end of generation: nothing follows it
            promised = sum(len(w.draft) + 1 for w in s.windows) - s.windows[0].at
            most = s.length.k if s.length is not None else MAX_DRAFT
            room = min(  # drafts after the guess
                most, budget - 1, s.limit - s.generated - promised - 1, self.slot_ctx - s.n_past - 2
            )
            proposal = s.drafter.propose(room + 1, ahead) if room >= 0 else ()
            ends = [i for i, t in enumerate(proposal) if self._is_end(t)]
            proposal = proposal[: ends[0] + 1] if ends else proposal
            if not proposal or self._is_end(proposal[0]):
                continue
            if s.acceptance is not None:
                copying = s.windows[0].copying
                k = follow_up_draft(
                    s.acceptance, self.window_cost, len(ahead), proposal, copying=copying
                )
                if k is None:
                    continue
                proposal = proposal[: k + 1]
            assert s.slot is not None
            guess, draft = proposal[0], tuple(proposal[1:])
            items.append(StepItem(s.id, s.slot, s.n_past, proposal, True, len(draft), True))
            s.windows.append(Window(s.n_past, draft, guess, copying=s.windows[0].copying))
            s.n_past += len(proposal)
            self._tokens += len(proposal)
            budget -= len(proposal)
        return items

    def _draft(self, s: SeqState, budget: int) -> tuple[int, ...]:
        assert s.drafter is not None
        most = s.length.k if s.length is not None else MAX_DRAFT
        room = min(most, budget, s.limit - s.generated - 1, self.slot_ctx - s.n_past - 1)
        # The drafter holds the prompt, the history and every token since: the pending one
        # is its last.
        proposal = s.drafter.propose(room) if room > 0 else ()
        s.copying = s.drafter.copying
        if s.acceptance is None or not proposal:
            return proposal
        k = best_draft(s.acceptance, self.window_cost, len(proposal), copying=s.copying)
        if not k:  # it would not pay: see whether its tokens would have been right
            if not s.shadow and not s.copying:  # (a copy's tokens are counted as they come)
                s.shadow, s.shadow_after = proposal, False
            return ()
        s.shadow = ()
        if k < len(proposal) and not s.copying:  # (a copy's tokens are counted as they come)
            s.beyond = proposal[k]
        return proposal[:k]

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of decode tokens only (one per sequence, plus drafts) took `seconds`."""
        self.window_cost.observe(tokens, seconds)

    def token(
        self,
        slot: int,
        token: int,
        timing: tuple[float, ...] = (),
        now: float | None = None,
        logprob: TokenLogprob | None = None,
    ) -> list[Event]:
        """A token sampled after a busy sequence's step: the only one, or the next of its
        window (see the module's docstring). Returns what to deliver: nothing for a
        cancelled sequence or a slot with no sequence waiting. With `now`, the window's trip
        (from `next_step` to its last token) is what a window of its length costs: a split's
        windows, which no single step times."""
        s = self._by_slot.get(slot)
        if s is None or not s.busy:
            return []
        w = s.windows[0]
        at, window = w.at, w.draft
        w.at += 1
        right = at < len(window) and token == window[at]
        guessed = w.guess is not None  # and right, or its window would have been void
        if at == 0 and (window or guessed):
            self._drafts[0] += 1
            self._drafts[1] += len(window) + guessed
            self._drafts[2] += guessed
        self._drafts[2] += right
        timing = timing if at == 0 else ()
        drafted, accepted, in_flight = len(window) + guessed, at + right + guessed, 0
        if not right:  # the window's last token: the first off the draft, or the one after it
            in_flight = len(s.windows) if drafted else 0
            s.windows.popleft()
            if s.beyond is not None:
                # Every drafted token was right and no window follows: the model's own token
                # here says whether the next proposed one would have been right too.
                if at == len(window) and not s.windows and s.acceptance is not None:
                    s.acceptance.then_seen(token == s.beyond)
                s.beyond = None
            if now is not None and w.sent_at is not None:
                self.window_cost.observe(len(window) + 1, now - w.sent_at)
            if not (at == len(window) and s.windows and s.windows[0].guess == token):
                # The windows after it guessed wrong: void, here and at the last stage.
                void = sum(len(v.draft) + 1 for v in s.windows)
                self._drafts[1] += void
                drafted += void
                s.behind_void = bool(s.windows)
                s.windows.clear()
                s.busy = False
                s.n_past = w.pos + 1 + at
            if s.length is not None and drafted:
                s.length.update(drafted, accepted)
            if s.acceptance is not None and drafted:
                judged = accepted + (accepted < drafted)
                s.acceptance.update(accepted, judged, run=w.guess is not None, copying=w.copying)
        if s.cancelled:
            if not s.busy:
                self._release(s)
            return []
        finish = None
        cached, s.announced = (0 if s.announced else s.cached), True
        if self._is_end(token):
            finish = "stop"
        else:
            s.tokens.append(token)
            s.generated += 1
            if s.generated >= s.limit:
                finish = "length"
        if finish is not None:
            # Nothing of it is in flight: a window never goes past a drafted end or the limit.
            self._release(s)
            done = Token(s.id, token, finish, timing, drafted, accepted, in_flight, cached, logprob)
            return [done]
        if s.drafter is not None:
            s.drafter.extend((token,))
        if s.shadow and s.acceptance is not None:
            hit = token == s.shadow[0]
            if s.shadow_after:
                s.acceptance.then_seen(hit)
            else:
                s.acceptance.update(hit, 1)
            s.shadow, s.shadow_after = (s.shadow[1:] if hit else ()), True
        if right:  # more of the window is coming
            return [Token(s.id, token, None, timing, cached=cached, logprob=logprob)]
        if not s.busy:  # no window follows: the token is the next step's input
            s.pending = [token]
            s.ready_since = self._steps
        return [Token(s.id, token, None, timing, drafted, accepted, in_flight, cached, logprob)]

    def fail(self, seqs: list[int], error: MeshError) -> list[Event]:
        """These sequences end with `error` (their slots are freed)."""
        events: list[Event] = []
        for seq in seqs:
            s = self._by_id.get(seq)
            if s is None:
                continue
            if not s.cancelled:
                events.append(Failed(seq, error))
            if s.slot is None:
                self._queue.remove(s)
                del self._by_id[seq]
                self._unblock(s)
            else:
                self._release(s, keep=False)  # its cache may hold half a step
        return events

    def fail_active(self, error: MeshError) -> list[Event]:
        """Every sequence holding a slot ends with `error` (the engine behind them broke)."""
        return self.fail([s.id for s in self._by_slot.values()], error)

    def close(self) -> None:
        """Refuse new sequences; those holding or waiting for a slot carry on."""
        self.closed = True

    def abort(self, error: MeshError) -> list[Event]:
        """Stop for good: every sequence, active or queued, ends with `error`."""
        self.closed = True
        return self.fail([*self._by_id], error)

    # ----- bookkeeping -----

    def _take_step(self, items: tuple[StepItem, ...]) -> Step:
        step = Step(
            items,
            tuple(self._opened),
            tuple(self._released),
            tuple(self._saves),
            tuple(self._dropped),
        )
        self._opened.clear()
        self._released.clear()
        self._saves.clear()
        self._dropped.clear()
        self._steps += 1
        return step

    def forget_prefixes(self) -> None:
        """The kept prefixes are gone (the executor's cache behind them was lost)."""
        if self.prefix is not None:
            self._dropped += self.prefix.clear()

    def _share_prompts(self) -> None:
        """Sequences whose prompt has all run keep its KV for those waiting to share it."""
        for s in list(self._by_slot.values()):
            if s.followers and s.n_past >= len(s.prompt):
                assert s.slot is not None and self.prefix is not None
                # Its slot holds the prompt's positions and no more: its first token has
                # not run yet (it runs in this step, after the saves).
                self._keep(s.slot, s.prompt)
                self._unblock(s)

    def _keep(self, slot: int, tokens: Sequence[int]) -> None:
        """Index `tokens` as a kept prefix; the executor saves their KV from `slot` at the
        next step (unless an entry already holds them)."""
        assert self.prefix is not None
        stored = self.prefix.insert(tokens)
        if stored.entry is not None:
            self._saves.append(Save(slot, stored.entry, len(tokens)))
        self._dropped += stored.dropped

    def _unblock(self, s: SeqState) -> None:
        """Those waiting for `s`'s prompt wait no more (it ran, or never will)."""
        followers, s.followers = s.followers, []
        for f in followers:
            f.waiting = False
        if followers:
            self._admit()

    def _release(self, s: SeqState, *, keep: bool = True) -> None:
        assert s.slot is not None
        if keep and s.cache and self.prefix is not None:
            # Its slot holds the KV of every token sent in a step whose verdict came (a
            # rejected draft's positions are cut by the executor), less the last sampled.
            self._keep(s.slot, s.tokens[: min(s.n_past, len(s.tokens))])
        del self._by_slot[s.slot]
        self._by_id.pop(s.id, None)
        self._released.append(s.slot)
        self._free.append(s.slot)
        s.busy = False
        s.windows.clear()
        s.cancelled = True  # whatever still names it is ignored from now on
        self._unblock(s)
        self._admit()

    def _admit(self) -> None:
        waiting: list[SeqState] = []  # passed over, in order: they go back to the queue's head
        while self._queue and self._free:
            s = self._queue.popleft()
            if s.waiting:
                waiting.append(s)
                continue
            s.slot = self._free.pop()
            s.pending = [*s.prompt, *s.history]
            s.ready_since = self._steps
            self._by_slot[s.slot] = s
            restore = None
            if s.cache and self.prefix is not None:
                # At least the last input token runs: its logits give the first token.
                restore = self.prefix.lookup(s.pending[:-1])
                if restore is not None:
                    s.cached = s.n_past = restore[1]
                    del s.pending[: s.cached]
                    self._prefix_tokens += s.cached
            self._opened.append(Opened(s.id, s.slot, s.sampling, s.history, restore))
        self._queue.extendleft(reversed(waiting))
