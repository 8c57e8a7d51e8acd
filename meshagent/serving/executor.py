"""Executors run the scheduler's steps: the per-token work next to the compute.

`ModelRunner` calls `run_step` on its worker thread, one step at a time. An executor that
samples itself (a local llama.cpp context) returns the tokens at once (for an item with a
draft, the tokens `verify` keeps, after dropping the rest of the window from its cache), and
the runner feeds them to the scheduler and takes the next step without returning to the event
loop. The entry of a split returns no tokens: they come back from the last stage later, through
`ModelRunner.tokens_ready`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog
import trio

from meshagent.engine.base import Constraint, Engine, ForwardItem
from meshagent.engine.windows import TEXT, WindowCheck, check_windows
from meshagent.serving.drafting import verify
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

    def run_step(self, step: Step) -> list[SampledToken]:
        """Run `step` (blocking, on the runner's worker thread). Returns the tokens sampled
        now for the items that wanted one; an executor whose tokens come later returns []."""
        ...

    async def run(self, runner: object, *, task_status: trio.TaskStatus[None]) -> None:
        """What the executor needs on the event loop while the runner serves (or nothing)."""
        ...


class LocalExecutor:
    """A whole model in one engine context: forward, then sample, on the worker thread."""

    depth = 1
    max_windows = 1  # its tokens come back with the step

    def __init__(self, engine: Engine, *, prefix_budget: int = 0) -> None:
        self.engine = engine
        self.prefix_budget = prefix_budget
        self.kept_size: Callable[[int], int] | None = None  # measured when `run` starts
        self._kept: dict[int, bytes] = {}  # prefix-cache entry -> its KV
        # Drafts need the rejected positions cut from the cache; a recurrent model's state
        # cannot be cut back, so it decodes without (a checkpoint of the state would do).
        self.speculates = engine.rewindable
        self.window_check: WindowCheck | None = None  # measured when `run` starts
        self.n_slots = engine.n_slots
        self.slot_ctx = engine.slot_ctx
        self._samplers: dict[int, Sampler] = {}  # slot -> sampler of the sequence in it

    def run_step(self, step: Step) -> list[SampledToken]:
        # Evicted entries go before the new ones come, so the kept bytes stay within the
        # budget; only those this step still restores or saves wait until after it.
        early, late = step.drops()
        for entry in early:
            self._kept.pop(entry, None)
        for save in step.saves:
            self._kept[save.entry] = self.engine.export_sequence(save.slot, save.tokens)
        for slot in step.released:
            self.engine.clear_sequence(slot)
            self._samplers.pop(slot, None)
        for op in step.opened:
            self._samplers[op.slot] = new_sampler(self.engine, op.sampling, op.history)
            if op.restore is not None:
                entry, keep = op.restore
                self.engine.import_sequence(op.slot, self._kept[entry])
                self.engine.trim_sequence(op.slot, keep)
        for entry in late:
            self._kept.pop(entry, None)
        if not step.items:
            return []
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
        return out

    @property
    def exact_windows(self) -> bool:
        return self.window_check is not None and self.window_check.exact

    def kept_bytes(self) -> int:
        """Bytes of KV kept for prefixes now (read from any thread: the worker may be adding
        one; list() of a dict's values is one step under the GIL)."""
        return sum(len(b) for b in list(self._kept.values()))

    @property
    def prefix_reason(self) -> str:
        """Why prompts do or do not start from kept prefixes (for `meshagent status`)."""
        if self.prefix_budget <= 0:
            return "off (--prefix-cache 0)"
        if not self.engine.rewindable:
            return "off: the model's state cannot be cut back to a shared prefix"
        if self.window_check is None:
            return "not checked yet (the model is loading)"
        if not self.window_check.exact:
            why = self.window_check.reason
            return f"off: a prefix computed in other batches would change tokens ({why})"
        return "on"

    @property
    def windows_reason(self) -> str:
        if not self.speculates:
            return "drafts are not verified here: the model's state cannot be cut back"
        if self.window_check is None:
            return "not checked yet (the model is loading)"
        return self.window_check.reason

    async def run(self, runner: object, *, task_status: trio.TaskStatus[None]) -> None:
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
    """What `export_sequence` of n tokens costs in bytes on `engine`: a fixed part and a part
    per token, measured on two lengths of one short text (the format is linear in its
    cells). Clears `slot`."""
    tokens = engine.tokenize(TEXT, add_bos=True)[:33]
    engine.clear_sequence(slot)
    try:
        engine.forward([ForwardItem(slot, 0, tokens, False)])
        sizes = [len(engine.export_sequence(slot, n)) for n in (len(tokens), 1)]
    finally:
        engine.clear_sequence(slot)
    per_token = (sizes[0] - sizes[1]) / (len(tokens) - 1)
    fixed = sizes[1] - per_token
    return lambda n: int(fixed + per_token * n + 0.5)
