"""Which sequences run next, and in what share: a sans-IO scheduler.

A plain object with no I/O and no threads: callers feed it events (a sequence is submitted, a
step is taken, a token is ready, a sequence is cancelled or fails) and it answers with the
next `Step` to run and the `Event`s to deliver (`serving/steps.py`). Executors (a local
llama.cpp context, the entry of a split) run the steps; `ModelRunner` guards the scheduler
with a lock and moves the events to the requests.

A sequence holds a slot from its admission to its end, or waits for one in a bounded queue.
It runs its prompt in chunks (from a kept prefix's KV where one holds its start,
`serving/prefix_cache.py`), then a decode *window* per step: its last token and any draft,
which the drafting policy decides (`serving/draft_policy.py`). Each rule is stated where it
is kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from meshagent.errors import ContextOverflow, MeshError, QueueFull, ShuttingDown
from meshagent.serving.copying import TokenNames
from meshagent.serving.draft_policy import DraftPolicy, Verdict
from meshagent.serving.drafting import WindowCost
from meshagent.serving.model_drafts import Key
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
    model_windows: int = 0  # of those, the draft model's windows, tokens and right ones
    model_tokens: int = 0
    model_accepted: int = 0
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
        self._is_end = is_end
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._queue: deque[SeqState] = deque()
        self._by_slot: dict[int, SeqState] = {}
        self._by_id: dict[int, SeqState] = {}
        self._opened: list[Opened] = []
        self._released: list[int] = []
        self._saves: list[Save] = []
        self._dropped: list[int] = []
        # Kept prefixes, where the executor can restore them (`_admit`, `_release`).
        self.prefix = prefix
        self._prefix_tokens = 0
        self._steps = 0
        self._tokens = 0
        self.drafting = DraftPolicy(
            slot_ctx=slot_ctx, is_end=is_end, max_windows=max_windows, names=token_name
        )
        self.closed = False

    @property
    def window_cost(self) -> WindowCost:
        """What a window costs next to a one-token step, as "auto" has learnt it."""
        return self.drafting.cost

    @property
    def max_windows(self) -> int:
        """Windows of one sequence in flight at once: more than one only where an executor
        sends a window before the verdict on the last comes back (a split's entry)."""
        return self.drafting.max_windows

    @max_windows.setter
    def max_windows(self, n: int) -> None:
        self.drafting.max_windows = n

    # ----- what callers ask -----

    def stats(self) -> SchedulerStats:
        drafts = self.drafting.counts
        return SchedulerStats(
            active=len(self._by_slot),
            queued=len(self._queue),
            slots=self.n_slots,
            max_queue=self.max_queue,
            tokens_processed=self._tokens,
            batches=self._steps,
            draft_windows=drafts.windows,
            draft_tokens=drafts.tokens,
            draft_accepted=drafts.accepted,
            model_windows=drafts.model_windows,
            model_tokens=drafts.model_tokens,
            model_accepted=drafts.model_accepted,
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
        """A new request: it takes a free slot, first come first served, or waits in the
        queue (at most `max_queue`). `limit` counts the tokens still to generate;
        `speculation`: "on" or "auto" to send drafts (`serving/draft_policy.py`), "off" not
        to; `cache`: it may start from a kept prefix, and leaves its own.

        `history`: a replayed completion's tokens so far (its chain broke), run after the
        prompt one per step, as they first ran; it wants a token only after the last. Those
        steps need no token back, so they follow each other into a pipeline without waiting;
        and since every token runs in a batch of the shape it first ran in, an engine whose
        results depend on the batch shape (llama.cpp's do, in the last bits) computes the same
        cache, and a seeded sampler draws the same next token.

        `after`: a sequence with the same prompt (`n` completions of one request), whose
        prefill this one waits for in the queue, to start from the KV it keeps of it
        (`_share_prompts`). Without kept prefixes, or when that one ends first, it prefills
        as any other.

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
        s.drafts = self.drafting.start(speculation, prompt, history, seq)
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
        """The request is gone: it leaves the queue, or frees its slot at once; a busy one
        (its step's token not back yet) when that token comes back, since a slot reused
        earlier could be handed the old sequence's token. Unknown or finished sequences are
        ignored."""
        s = self._by_id.get(seq)
        if s is None:
            return
        if s.slot is None:
            self._queue.remove(s)
            del self._by_id[seq]
            self.drafting.end(s)
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
        through `token` with a `now` too (a split's).

        A step packs one decode token per decoding sequence (or replayed token), then drafts
        within half of the budget left, then chunks of prompts, within `max_batch_tokens`: a
        long prompt never stalls the sequences that are decoding, and prompts keep moving.
        The sequence that has waited longest is considered first, so none starves; with a
        pipeline of `depth` stages a step takes at most 1/depth of the active sequences (at
        least one), so that `depth` groups are in flight and no stage waits for work. A
        sequence whose input is all in the step is *busy* until its token is ready."""
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
            if takes.get(s.id) == 1 and len(s.pending) == 1:
                draft = self.drafting.draft(s, draft_budget)
                if draft:
                    drafts[s.id] = draft
                    draft_budget -= len(draft)
                    budget -= len(draft)
        for s in share:  # prompt chunks, never past the prompt's end
            if s.id not in takes and budget > 0:
                takes[s.id] = min(len(s.prompt) - s.n_past, budget)
                budget -= takes[s.id]
        items = [
            self._put(s, takes[s.id], drafts.get(s.id, ()), now) for s in share if takes.get(s.id)
        ]
        if self.max_windows > 1:
            ran = {it.seq for it in items}  # (a window is not followed in its own step)
            items += self._follow_ups(min(draft_budget, budget), ran)
        if not items and not self._released and not self._saves:
            return None
        return self._take_step(tuple(items))

    def _put(self, s: SeqState, take: int, draft: tuple[int, ...], now: float | None) -> StepItem:
        """The item of `s` in the step being taken: its next `take` input tokens, then
        `draft`. Where that is all its input, it is busy, with a window in flight."""
        assert s.slot is not None
        tokens = (*s.pending[:take], *draft)
        del s.pending[:take]
        last = not s.pending
        if last:  # a decode step's trip is timed
            sent_at = now if take == 1 and not s.behind_void else None
            copying = bool(draft) and s.drafts is not None and s.drafts.copying
            model = bool(draft) and self.drafting.from_model(s)
            s.windows.append(
                Window(s.n_past + take - 1, draft, sent_at=sent_at, copying=copying, model=model)
            )
            s.behind_void = False
        item = StepItem(s.id, s.slot, s.n_past, tokens, last, len(draft))
        s.n_past += len(tokens)
        s.busy = last
        s.busy_in = self._steps
        s.ready_since = self._steps + 1  # a prompt's next chunk waits behind the others
        self._tokens += len(tokens)
        return item

    def _follow_ups(self, budget: int, ran: set[int]) -> list[StepItem]:
        """Windows sent before the verdict on those in flight (`DraftPolicy.follow_up`), by
        busy sequences that did not run in this step, longest waiting first. Where a
        window's verdict differs from what those after it assumed, they are void, here
        and at the last stage alike (`_close_window`)."""
        items = []
        busy = [s for s in self._by_slot.values() if s.busy and not s.cancelled and s.windows]
        for s in sorted(busy, key=lambda s: (s.ready_since, s.id)):
            proposal = () if s.id in ran else self.drafting.follow_up(s, budget)
            if not proposal:
                continue
            assert s.slot is not None
            guess, draft = proposal[0], tuple(proposal[1:])
            items.append(StepItem(s.id, s.slot, s.n_past, proposal, True, len(draft), True))
            model = self.drafting.from_model(s)
            s.windows.append(
                Window(s.n_past, draft, guess, copying=s.windows[0].copying, model=model)
            )
            s.n_past += len(proposal)
            self._tokens += len(proposal)
            budget -= len(proposal)
        return items

    def drafts_wanted(self) -> list[tuple[int, int, tuple[int, ...], Key]]:
        """What the draft model should propose before the next step (`DraftPolicy.wanted`):
        (sequence, at most how many tokens, after which in flight, for which point) each."""
        out = []
        for s in sorted(self._by_slot.values(), key=lambda s: (s.ready_since, s.id)):
            want = self.drafting.wanted(s)
            if want is not None:
                out.append((s.id, *want))
        return out

    def catch_ups_wanted(self, now: float | None = None) -> list[tuple[int, int]]:
        """(sequence, tokens) the draft model should read of their text now, proposing
        nothing (`DraftPolicy.catch_up_wanted`)."""
        out = []
        for s in self._by_slot.values():
            if n := self.drafting.catch_up_wanted(s, now):
                out.append((s.id, n))
        return out

    def caught_up(self, seq: int, tokens: int, seconds: float) -> None:
        s = self._by_id.get(seq)
        if s is not None:
            self.drafting.caught_up(s, tokens, seconds)

    def offer_draft(
        self, seq: int, key: Key, proposal: tuple[int, ...], seconds: float = 0.0
    ) -> None:
        """The draft model's `proposal` for `seq` at `key` (`drafts_wanted`), computed in
        `seconds`."""
        s = self._by_id.get(seq)
        if s is not None:
            self.drafting.offer(s, key, proposal, seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        """A step of decode tokens only (one per sequence, plus drafts) took `seconds`."""
        self.drafting.observe(tokens, seconds)

    def token(
        self,
        slot: int,
        token: int,
        timing: tuple[float, ...] = (),
        now: float | None = None,
        logprob: TokenLogprob | None = None,
    ) -> list[Event]:
        """A token sampled after a busy sequence's step: the only one, or the next of its
        window. Returns what to deliver: nothing for a cancelled sequence or a slot with no
        sequence waiting. With `now`, the window's trip (from `next_step` to its last token)
        is what a window of its length costs: a split's windows, which no single step times."""
        s = self._by_slot.get(slot)
        if s is None or not s.busy:
            return []
        window = s.windows[0]
        verdict = self.drafting.judge(window, token)
        if not verdict.right:
            verdict = self._close_window(s, verdict, token, now)
        if s.cancelled:
            if not s.busy:
                self._release(s)
            return []
        cached, s.announced = (0 if s.announced else s.cached), True
        finish = self._append(s, token)
        if finish is None:
            self._go_on(s, token)
        else:  # nothing of it is in flight: no window goes past a drafted end or the limit
            self._release(s)
        ends = finish is not None or not verdict.right  # the last of its window: the tally
        tally = (verdict.drafted, verdict.accepted, verdict.windows) if ends else (0, 0, 0)
        timing = timing if verdict.at == 0 else ()  # the step's, on its window's first token
        model = ends and window.model
        return [Token(s.id, token, finish, timing, *tally, cached, logprob, model)]

    def _close_window(
        self, s: SeqState, verdict: Verdict, token: int, now: float | None
    ) -> Verdict:
        """`token` ends the sequence's oldest window in flight: it is the first that differs
        from the draft, or the one after it. The windows sent after it stand where it ends
        with the token the next one guessed; else they are void (the last stage, which knows
        the same, samples nothing for them), and the sequence goes on from `token`: the
        executor keeps its cache's accepted positions and drops the rest. Returns the
        verdict with the window's tally."""
        w = s.windows.popleft()
        in_flight = len(s.windows) + 1 if verdict.drafted else 0
        stands = bool(s.windows) and verdict.at == len(w.draft) and s.windows[0].guess == token
        void = 0 if stands else sum(len(v.draft) + 1 for v in s.windows)
        verdict = replace(verdict, drafted=verdict.drafted + void, windows=in_flight)
        self.drafting.closed(s, w, verdict, token, void=void, now=now)
        if stands:
            s.windows[0].stood = True  # `token`, its guess, is the sequence's now
        else:
            s.behind_void = bool(s.windows)
            s.windows.clear()
            s.busy = False
            s.n_past = w.pos + 1 + verdict.at
        return verdict

    def _append(self, s: SeqState, token: int) -> str | None:
        """The sequence's text goes on with `token`; returns why it ends there, if it does:
        "stop" (an end of generation, which is not part of the text) or "length"."""
        if self._is_end(token):
            return "stop"
        s.tokens.append(token)
        s.generated += 1
        return "length" if s.generated >= s.limit else None

    def _go_on(self, s: SeqState, token: int) -> None:
        """The sequence goes on after `token`: its drafts read it, and with no window in
        flight it is the next step's input."""
        self.drafting.read(s, token)
        if not s.busy:
            s.pending = [token]
            s.ready_since = self._steps

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
                self.drafting.end(s)
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
        """Sequences whose prompt has all run keep its KV as an entry (a `Save` of a live
        slot, before its first decode token runs) for those waiting to share it (`after`),
        which then start from it: `n` completions of one request prefill their prompt once."""
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
        """Free the sequence's slot (the executor clears it at the next step). One that may
        keep prefixes leaves, unless it failed (`keep`), the KV of the tokens its slot holds
        as an entry (`Step.saves`, before the slot is cleared); entries the index evicts for
        it are in `Step.dropped`."""
        assert s.slot is not None
        if keep and s.cache and self.prefix is not None:
            # Its slot holds the KV of every token sent in a step whose verdict came (a
            # rejected draft's positions are cut by the executor), less the last sampled.
            self._keep(s.slot, s.tokens[: min(s.n_past, len(s.tokens))])
        del self._by_slot[s.slot]
        self._by_id.pop(s.id, None)
        self.drafting.end(s)
        self._released.append(s.slot)
        self._free.append(s.slot)
        s.busy = False
        s.windows.clear()
        s.cancelled = True  # whatever still names it is ignored from now on
        self._unblock(s)
        self._admit()

    def _admit(self) -> None:
        """Queued sequences take the free slots in order, but for those waiting for another's
        prompt. One that may reuse kept prefixes starts from the longest prefix of its input
        that an entry holds: `Opened.restore` tells the executor to load that entry's KV into
        the slot and cut it to the shared length, and only the rest is prefilled."""
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
                    _entry, shared = restore
                    s.cached = s.n_past = shared
                    del s.pending[: s.cached]
                    self._prefix_tokens += s.cached
            self._opened.append(Opened(s.id, s.slot, s.sampling, s.history, restore))
        self._queue.extendleft(reversed(waiting))
