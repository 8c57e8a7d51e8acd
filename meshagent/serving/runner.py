"""The serving loop of one model: a scheduler, an executor, and a worker thread between them.

The worker thread takes a step from the scheduler, runs it with the executor, feeds the
tokens it sampled back to the scheduler and takes the next step, all without the event loop:
per token the event loop only receives the new token ids (one hand-off per step, not per
sequence) and turns them into text for the clients. Requests enter with `start`, which
returns a `SequenceHandle` to read the tokens from.

The runner is the one place that crosses between the worker thread and the event loop: the
worker hands the loop each step's events and what an executor left to do there
(`StepDone.outgoing`, given to `Executor.deliver`), never waiting for the loop; the loop wakes
the worker through the scheduler's lock. Executors see only the runner's `ExecutorSink`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable

import structlog
import trio

from meshagent.errors import EngineError, MeshError
from meshagent.serving.copying import TokenNames
from meshagent.serving.executor import Executor, SampledToken, StepDone
from meshagent.serving.prefix_cache import PrefixIndex
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.scheduler import Scheduler, SchedulerStats
from meshagent.serving.steps import Event, Failed, Step, Token

log = structlog.get_logger(__name__)

_SWITCH_INTERVAL = 0.0002  # seconds; see ModelRunner.run
_HANDOVER = 0.001  # seconds at most; see ModelRunner.tokens_ready


class SequenceHandle:
    """One request's tokens, as the runner produces them. `close` (or leaving `async with`)
    cancels the sequence if it has not finished."""

    def __init__(self, runner: ModelRunner, seq: int) -> None:
        self.seq = seq
        self._runner = runner
        self._send, self._recv = trio.open_memory_channel[Event](math.inf)
        self.finished = False

    def _put(self, event: Event) -> None:
        self._send.send_nowait(event)

    async def next(self) -> Token:
        """The next token; raises the sequence's error if it failed."""
        event = await self._recv.receive()
        if isinstance(event, Failed):
            self.finished = True
            raise event.error
        if event.finish is not None:
            self.finished = True
        return event

    def close(self) -> None:
        self._runner._forget(self.seq, cancel=not self.finished)

    async def __aenter__(self) -> SequenceHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ModelRunner:
    def __init__(
        self,
        executor: Executor,
        *,
        max_queue: int,
        is_end: Callable[[int], bool],
        max_batch_tokens: int = 512,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        """`token_bytes`: the vocabulary's text of a token, which lets drafts tell a renamed
        name in its other spellings (`serving/copying.py`)."""
        self.executor = executor
        self.slot_ctx = executor.slot_ctx
        self.scheduler = Scheduler(
            n_slots=executor.n_slots,
            slot_ctx=executor.slot_ctx,
            max_queue=max_queue,
            is_end=is_end,
            max_batch_tokens=max_batch_tokens,
            depth=executor.depth,
            max_windows=executor.max_windows,
            token_name=TokenNames(token_bytes) if token_bytes is not None else None,
        )
        self.aborted: MeshError | None = None
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)  # the scheduler's; the worker waits on it
        # A split's entry with a draft model: a thread of its own reads sequences' text into
        # the draft model (`_read_work`) while the worker sends steps; it waits on this, and
        # `_read_job` is its one task, the draft model's engine its own until it is done.
        self._reader = threading.Condition(mutex)
        self._read_job: tuple[int, int] | None = None
        self._handles: dict[int, SequenceHandle] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._idle = False  # the worker waits for a step
        self._took = threading.Event()  # set: the worker took a step, or found none
        self._token: trio.lowlevel.TrioToken | None = None
        self._shares: dict[str, int] = {}  # a shared prompt's key -> the sequence prefilling it
        self.peak_steps_in_flight = 0  # most steps whose tokens were not all back, at once
        self.largest_step = 0  # sequences in the biggest step so far
        self.sink = _Sink(self)

    # ----- the event loop's side -----

    def stats(self) -> SchedulerStats:
        with self._lock:
            return self.scheduler.stats()

    def start(
        self,
        prompt: tuple[int, ...],
        limit: int,
        sampling: SamplingParams,
        history: tuple[int, ...] = (),
        *,
        speculation: str = "off",
        share: str | None = None,
    ) -> SequenceHandle:
        """Submit a request (a replayed one with its `history`, see `Scheduler.submit`); its
        tokens arrive on the handle. `speculation` ("auto", "on", "off") is honoured where
        the executor verifies drafts; "auto" only where its windows are exact. Requests
        with the same `share` key (the completions of one request, same prompt) prefill the
        prompt once: the first, and the others start from its KV. Raises what
        `Scheduler.submit` raises (QueueFull, ShuttingDown, ContextOverflow)."""
        if self.aborted is not None:
            raise self.aborted
        handle = SequenceHandle(self, next(self._ids))
        with self._lock:
            if not self.executor.speculates or (
                speculation == "auto" and not self.executor.exact_windows
            ):
                speculation = "off"  # auto drafts only where it changes no token
            after = None if share is None else self._shares.get(share)
            self.scheduler.submit(
                handle.seq,
                prompt,
                limit,
                sampling,
                history,
                speculation=speculation,
                cache=True,
                after=after,
            )
            if share is not None and after is None:
                self._shares[share] = handle.seq
            self._handles[handle.seq] = handle
            self._lock.notify()
        return handle

    def close(self) -> None:
        """Refuse new requests; those admitted carry on."""
        with self._lock:
            self.scheduler.close()

    def abort(self, reason: str | MeshError) -> None:
        """Stop for good: every request admitted or queued fails with `reason` (an
        EngineError, unless it is an error already)."""
        error = reason if isinstance(reason, MeshError) else EngineError(reason)
        self.aborted = error
        self.fail_all(error, queued=True)

    def fail_all(self, error: MeshError, *, queued: bool = False) -> None:
        """Every active request (and with `queued`, every waiting one too) fails with
        `error`: the engine or the chain behind them broke."""
        with self._lock:
            sched = self.scheduler
            events = sched.abort(error) if queued else sched.fail_active(error)
            self._lock.notify()
        self._deliver(events)

    def chain_broke(self, error: MeshError) -> int:
        """Every active request fails with `error`, and the kept prefixes are gone (a split's
        chain broke: its stages held them); forgotten first, so that no request admitted as
        these fail starts from one. Returns the id the next kept prefix will get: every
        entry below it is forgotten."""
        next_id = self.forget_prefixes()
        self.fail_all(error)
        return next_id

    def forget_prefixes(self) -> int:
        """The kept prefixes are gone. Returns the id the next kept prefix will get: every
        entry below it is forgotten."""
        with self._lock:
            self.scheduler.forget_prefixes()
            prefix = self.scheduler.prefix
            return 0 if prefix is None else prefix.next_id

    def rebudget(self, budget: int) -> None:
        """Keep prefixes within `budget` bytes from now on (a split's stages changed, and
        with them the room they have for them)."""
        self.executor.prefix_budget = budget
        with self._lock:
            if self.scheduler.prefix is not None:
                self.scheduler.prefix.budget = budget

    def tokens_ready(self, tokens: list[SampledToken]) -> None:
        """Tokens sampled elsewhere (a split's last stage), on the event loop.

        When the worker is idle, the event loop lets it take its next step before it turns
        the tokens into text: both want the GIL, and the worker, which starts the next
        token's compute, is the one on the critical path. Left to the interpreter, the
        worker waits for the switch interval while the loop writes to the clients (about
        0.3 ms per token of a split here). The wait ends when the worker holds its step or
        finds none, and lasts `_HANDOVER` at most."""
        with self._lock:
            now = time.perf_counter()  # the trip of each window that ends here (auto's cost)
            sched = self.scheduler
            events = [
                e for slot, tok, ms, lp in tokens for e in sched.token(slot, tok, ms, now, lp)
            ]
            self._lock.notify()
            handing = self._idle
            if handing:
                self._took.clear()
        if handing:
            self._took.wait(_HANDOVER)
        self._deliver(events)

    def fail_slot(self, slot: int, error: MeshError) -> None:
        """The sequence in `slot` fails with `error` (on the event loop)."""
        with self._lock:
            seq = self.scheduler.seq_in(slot)
            events = [] if seq is None else self.scheduler.fail([seq], error)
            self._lock.notify()
        self._deliver(events)

    def busy(self) -> bool:
        """Some sequence waits for a token from its executor."""
        with self._lock:
            return self.scheduler.any_busy()

    def steps_in_flight(self) -> int:
        """Steps whose tokens are not all back yet (a split keeps several in flight)."""
        with self._lock:
            return self.scheduler.steps_in_flight()

    def _forget(self, seq: int, *, cancel: bool) -> None:
        self._handles.pop(seq, None)
        for key in [k for k, s in self._shares.items() if s == seq]:
            del self._shares[key]
        if cancel:
            with self._lock:
                self.scheduler.cancel(seq)
                self._lock.notify()

    def _deliver(self, events: list[Event]) -> None:
        for ev in events:
            handle = self._handles.get(ev.seq)
            if handle is not None:
                handle._put(ev)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; a step in progress finishes first."""
        self._token = trio.lowlevel.current_trio_token()
        # When a step's compute ends, the worker needs the GIL at once to sample and start
        # the next step; with CPython's default 5 ms switch interval it can wait that long
        # for the event loop thread to let go of it, per token.
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.executor.run, self.sink)
            size = self.executor.kept_size
            if size is not None:  # the executor keeps ended sequences' KV for their prefixes
                with self._lock:
                    self.scheduler.prefix = PrefixIndex(
                        self.executor.prefix_budget,
                        size,
                        whole=not self.executor.cuts_prefixes,
                    )
            drafting = self.scheduler.drafting
            if drafting.model is not None and drafting.max_windows > 1:
                drafting.reads_apart = True
                nursery.start_soon(self._read_in_thread)
            nursery.start_soon(self._work_in_thread)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with self._lock:
                    self._stopping = True
                    self._lock.notify()
                    self._reader.notify()

    async def _work_in_thread(self) -> None:
        # Not abandoned on cancel: the engine must not be freed under a running step.
        await trio.to_thread.run_sync(self._work)

    async def _read_in_thread(self) -> None:
        # Not abandoned on cancel either: the draft model's engine is freed after the runner.
        await trio.to_thread.run_sync(self._read_work)

    # ----- the worker thread -----

    def _next(self) -> Step | None:
        while True:
            read = self._prepare_drafts()
            with self._lock:
                if self._stopping:
                    return None
                step = self.scheduler.next_step(time.perf_counter())
                self._took.set()  # (tokens_ready)
                if step is not None:
                    if step.items:
                        self.largest_step = max(self.largest_step, len(step.items))
                        if self.executor.depth > 1:  # (one step at a time otherwise)
                            in_flight = self.scheduler.steps_in_flight()
                            self.peak_steps_in_flight = max(self.peak_steps_in_flight, in_flight)
                    return step
                if read:  # the draft model read on: it may read more before the tokens come
                    continue
                self._idle = True
                self._lock.wait()
                self._idle = False

    def _prepare_drafts(self) -> bool:
        """The draft model's proposals the next step will want (`Scheduler.drafts_wanted`),
        computed here, outside the lock: the event loop, which takes the lock to submit,
        cancel and hand over a split's tokens, never waits for a draft. Else its catching up
        on sequences' text while their windows travel; whether it read any."""
        model = self.scheduler.drafting.model
        if model is None:
            return False
        with self._lock:
            if self._read_job is not None:
                return False  # (the reader holds the draft model: the steps go meanwhile)
            wanted = self.scheduler.drafts_wanted()
        for seq, k, after, key in wanted:
            forwards, started = model.forwards, time.perf_counter()
            proposal = tuple(model.propose(seq, k, after))
            spent = time.perf_counter() - started
            with self._lock:
                if model.forwards > forwards:  # its forward passes of one token, then its feed
                    timed = self.scheduler.drafting.model_timed
                    timed(model.last_steps, 1, model.last_steps_seconds)
                    timed(1, model.last_fed, model.last_feed_seconds)
                self.scheduler.offer_draft(seq, key, proposal, spent)
        if wanted:
            return False
        with self._lock:  # nothing to propose: read on where catching up is worth it
            catch_ups = self.scheduler.catch_ups_wanted(time.perf_counter())
            if self.scheduler.drafting.reads_apart:  # by the reader, beside the steps
                if catch_ups:
                    self._read_job = catch_ups[0]
                    self._reader.notify()
                return False
        read = False
        for seq, n in catch_ups:
            started = time.perf_counter()
            fed = model.catch_up(seq, n)
            read |= fed > 0
            with self._lock:
                self.scheduler.caught_up(seq, fed, time.perf_counter() - started)
        return read

    def _read_work(self) -> None:
        """The reader's loop: read what the worker asked of the draft model (`_read_job`),
        one sequence's text at a time, until the runner stops. A draft model that fails to
        read here stops the reader: the worker then reads within the trips, as it does where
        there is no reader (`DraftPolicy.catch_up_wanted`)."""
        drafting = self.scheduler.drafting
        model = drafting.model
        assert model is not None
        while drafting.reads_apart:
            with self._reader:
                while self._read_job is None and not self._stopping:
                    self._reader.wait()
                if self._stopping:
                    return
                seq, most = self._read_job
            started = time.perf_counter()
            try:
                fed = model.catch_up(seq, most)
            except Exception as e:  # (a draft model's failure costs its drafts, no request)
                log.error("draft_model.read_failed", error=str(e))
                fed, failed = 0, True
            else:
                failed = False
            with self._lock:
                if failed:
                    drafting.reads_apart = False
                self.scheduler.caught_up(seq, fed, time.perf_counter() - started)
                self._read_job = None
                self._lock.notify()  # the worker may ask for drafts now

    def _work(self) -> None:
        while (step := self._next()) is not None:
            try:
                started = time.perf_counter()
                done: StepDone = self.executor.run_step(step)
                spent = time.perf_counter() - started
            except Exception as e:  # an engine failure fails this step's requests, not the agent
                log.error("engine.step_failed", error=str(e), sequences=len(step.items))
                error = e if isinstance(e, MeshError) else EngineError(f"inference failed: {e}")
                with self._lock:
                    events = self.scheduler.fail([it.seq for it in step.items], error)
            else:
                if done.outgoing is not None:
                    self._handoff(self.executor.deliver, done.outgoing)
                sampled = done.tokens
                if not sampled:
                    continue
                decoding = all(it.last and len(it.tokens) == it.draft + 1 for it in step.items)
                with self._lock:
                    if decoding:  # what a window costs here, for "auto" (sampled at once)
                        self.scheduler.observe(sum(len(it.tokens) for it in step.items), spent)
                    token = self.scheduler.token
                    events = [e for s, t, ms, lp in sampled for e in token(s, t, ms, None, lp)]
            if events:
                self._handoff(self._deliver, events)

    def _handoff(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the event loop soon (from the worker thread, without waiting)."""
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # the agent is exiting
            self._token.run_sync_soon(fn, *args)


class _Sink:
    """The runner as its executor sees it (`ExecutorSink`), on the event loop."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    def tokens(self, tokens: list[SampledToken]) -> None:
        self._runner.tokens_ready(tokens)

    def failed(self, slot: int, error: MeshError) -> None:
        self._runner.fail_slot(slot, error)

    def broken(self, error: MeshError) -> int:
        return self._runner.chain_broke(error)
