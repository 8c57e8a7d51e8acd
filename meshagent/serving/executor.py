"""Executors run the scheduler's steps: the per-token work next to the compute.

`ModelRunner` calls `run_step` on its worker thread, one step at a time, and gets a
`StepDone`. An executor that samples itself (a local llama.cpp context) has the tokens at once
(for an item with a draft, the tokens `verify` keeps, after dropping the rest of the window
from its cache), and the runner feeds them to the scheduler and takes the next step without
returning to the event loop. The entry of a split has none yet: its `StepDone` holds what goes
down the chain, which the runner hands to the executor's `deliver` on the event loop; the
tokens come back from the last stage later, and the executor tells them to its `ExecutorSink`.

The runner is the only one to cross between the worker thread and the event loop. An executor
knows nothing of it but the sink: tokens sampled elsewhere, a sequence that failed, a chain
that broke.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
import trio

from meshagent.engine.base import Constraint, Engine, ForwardItem
from meshagent.engine.windows import TEXT, WindowCheck, check_windows
from meshagent.errors import MeshError
from meshagent.serving.drafting import verify
from meshagent.serving.kv_book import KvBook
from meshagent.serving.kv_book import measure_kept_size as measure_book
from meshagent.serving.sampling import Sampler, SamplingParams, TokenLogprob
from meshagent.serving.steps import Step

log = structlog.get_logger(__name__)

# (slot, token, timing per stage, its log-probability where the request asked for them)
SampledToken = tuple[int, int, tuple[float, ...], TokenLogprob | None]


class ConstraintSource(Protocol):
    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> Constraint: ...


def new_sampler(
    engine: ConstraintSource, params: SamplingParams, history: tuple[int, ...] = ()
) -> Sampler:
    """A sampler for one sequence, constrained by its grammar (over `engine`'s vocabulary)
    where it has one."""
    grammar, trigger = params.grammar, params.grammar_trigger
    close = params.close_within
    constraint = None if grammar is None else engine.constraint(grammar, trigger, close)
    return Sampler(params, history, constraint)


def with_logprobs(
    slot: int, tokens: list[int], timing: tuple[float, ...], sampler: Sampler
) -> list[SampledToken]:
    """`tokens` just sampled by `sampler`, as SampledTokens with their log-probabilities."""
    lps: list[TokenLogprob | None] = list(sampler.take_logprobs()) or [None] * len(tokens)
    return [(slot, t, timing, lp) for t, lp in zip(tokens, lps, strict=True)]


@dataclass(frozen=True)
class StepDone:
    """What a step gave on the worker thread: the tokens sampled now, and what the executor
    still has to do on the event loop (`Executor.deliver`; None: nothing)."""

    tokens: list[SampledToken]
    outgoing: object | None = None


NOTHING_YET = StepDone([])


class ExecutorSink(Protocol):
    """What an executor tells the runner it serves, on the event loop."""

    def tokens(self, tokens: list[SampledToken]) -> None:
        """Tokens sampled elsewhere (a split's last stage)."""
        ...

    def failed(self, slot: int, error: MeshError) -> None:
        """The sequence in `slot` failed."""
        ...

    def broken(self, error: MeshError) -> int:
        """Every sequence in flight failed with `error` (a split's chain broke), and the kept
        prefixes are gone with the stages that held them. Returns the id the next kept prefix
        gets: every entry below it is forgotten."""
        ...


# The prefix cache of a model with a recurrent state: its state is kept as it was at each kept
# prefix's end, so a prompt starts from an entry only where it holds all of it.
WHOLE_PREFIXES = "on (whole kept prefixes only: the model keeps a recurrent state)"


class Executor(Protocol):
    n_slots: int
    slot_ctx: int
    depth: int  # stages a step passes through: the scheduler keeps this many groups in flight
    speculates: bool  # verifies steps with drafts (StepItem.draft)
    # Windows of one sequence it takes before the first's tokens are back (StepItem.follows):
    # 1 where a step's tokens come back with the step.
    max_windows: int
    exact_windows: bool  # a verified window computes what one-token steps compute
    windows_reason: str  # why, or why not (for `meshagent status`)
    # Bytes it may keep of ended sequences' KV for later prompts that share their prefix, and
    # what an entry of n tokens costs (None: it keeps none; see `serving/prefix_cache.py`).
    prefix_budget: int
    kept_size: Callable[[int], int] | None
    prefix_reason: str  # why prompts do or do not start from kept prefixes
    # Whether a kept prefix can be restored cut short (a KV cache), or only whole (a recurrent
    # state is kept as it was at the entry's end).
    cuts_prefixes: bool

    def run_step(self, step: Step) -> StepDone:
        """Run `step` (blocking, on the runner's worker thread): the tokens sampled now for
        the items that wanted one (none where they come later), and what is left to do on
        the event loop."""
        ...

    def deliver(self, outgoing: object) -> None:
        """On the event loop: the rest of a step (`StepDone.outgoing`)."""
        ...

    async def run(self, sink: ExecutorSink, *, task_status: trio.TaskStatus[None]) -> None:
        """What the executor needs on the event loop while the runner serves (or nothing);
        what it learns there it tells `sink`."""
        ...


class LocalExecutor:
    """A whole model in one engine context: forward, then sample, on the worker thread."""

    depth = 1
    max_windows = 1  # its tokens come back with the step

    def __init__(self, engine: Engine, *, prefix_budget: int = 0) -> None:
        self.engine = engine
        self.prefix_budget = prefix_budget
        self.kept_size: Callable[[int], int] | None = None  # measured when `run` starts
        self.book = KvBook(engine)  # what is kept is the scheduler's to decide, within budget
        # Drafts need the rejected positions cut from the cache: a KV cache is cut anywhere, a
        # recurrent state from the checkpoint taken before its window (engine/checkpoints.py).
        self.speculates = True
        self.cuts_prefixes = engine.rewindable
        self.window_check: WindowCheck | None = None  # measured when `run` starts
        self.n_slots = engine.n_slots
        self.slot_ctx = engine.slot_ctx
        self._samplers: dict[int, Sampler] = {}  # slot -> sampler of the sequence in it

    def run_step(self, step: Step) -> StepDone:
        self.book.apply(step)
        for slot in step.released:
            self._samplers.pop(slot, None)
        for op in step.opened:
            self._samplers[op.slot] = new_sampler(self.engine, op.sampling, op.history)
        if not step.items:
            return NOTHING_YET
        items = [
            ForwardItem(it.slot, it.pos, it.tokens, it.last, it.draft + 1) for it in step.items
        ]
        results = self.engine.forward(items)
        out: list[SampledToken] = []
        for it, logits in zip(step.items, results, strict=True):
            if not it.last:
                continue
            assert logits is not None
            sampler = self._samplers[it.slot]
            if not it.draft:
                out += with_logprobs(it.slot, [sampler.sample(logits)], (), sampler)
                continue
            draft = it.tokens[-it.draft :]
            tokens = verify(sampler, logits, draft, is_end=self.engine.is_end_of_generation)
            # Keep the cache up to the last accepted draft token; the one after it is not in.
            self.engine.trim_sequence(it.slot, it.pos + len(it.tokens) - it.draft + len(tokens) - 1)
            out += with_logprobs(it.slot, tokens, (), sampler)
        return StepDone(out)

    def deliver(self, outgoing: object) -> None:
        raise AssertionError("a whole model's steps leave nothing for the event loop")

    @property
    def exact_windows(self) -> bool:
        return self.window_check is not None and self.window_check.exact

    def kept_bytes(self) -> int:
        """Bytes of KV kept for prefixes now (read from any thread)."""
        return self.book.kept_bytes()

    @property
    def prefix_reason(self) -> str:
        """Why prompts do or do not start from kept prefixes (for `meshagent status`)."""
        if self.prefix_budget <= 0:
            return "off (--prefix-cache 0)"
        if self.window_check is None:
            return "not checked yet (the model is loading)"
        if not self.window_check.exact:
            why = self.window_check.reason
            return f"off: a prefix computed in other batches would change tokens ({why})"
        return "on" if self.cuts_prefixes else WHOLE_PREFIXES

    @property
    def windows_reason(self) -> str:
        if self.window_check is None:
            return "not checked yet (the model is loading)"
        return self.window_check.reason

    async def run(self, sink: ExecutorSink, *, task_status: trio.TaskStatus[None]) -> None:
        if self.speculates and self.window_check is None:
            self.window_check = await trio.to_thread.run_sync(check_windows, self.engine)
            log.info(
                "engine.windows_checked",
                exact=self.window_check.exact,
                max_diff=self.window_check.max_diff,
                reason=self.window_check.reason,
            )
        # A kept prefix gives the tokens a prefill of the same text gives only where a token's
        # KV does not depend on the batch it ran in: what the window check shows.
        if self.prefix_budget > 0 and self.exact_windows:
            self.kept_size = await trio.to_thread.run_sync(measure_kept_size, self.engine)
        # The runner owns every slot from now on: nothing an earlier runner left behind in
        # the engine's cache may meet its sequences.
        for slot in range(self.n_slots):
            self.engine.clear_sequence(slot)
        task_status.started()


def measure_kept_size(engine: Engine, *, slot: int = 0) -> Callable[[int], int]:
    """What `export_sequence` of n tokens costs in bytes on `engine` (`kv_book`). Clears
    `slot`."""
    tokens = engine.tokenize(TEXT, add_bos=True)[:33]

    def prefill(slot: int, tokens: list[int]) -> None:
        engine.forward([ForwardItem(slot, 0, tokens, False)])

    return measure_book(engine, prefill, tokens, slot=slot)
