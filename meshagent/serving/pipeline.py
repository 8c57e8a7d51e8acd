"""The entry of a split model: tokenizer, embeddings and the first stage on this agent, the
rest of the layers on other peers.

`PipelineExecutor` runs each step's first stage on the runner's worker thread and streams the
hidden states to the next stage, without waiting for the step before it to come back, so
several rounds (different sequences) are in the pipeline at once and the stages compute in
parallel. The scheduler makes that happen: with `depth` stages a step takes at most 1/depth
of the active sequences, so with four requests and three stages each travels as a group of
its own, and while one group is in the second stage another is in the first. Tokens come back
straight from the last stage on a reply stream and go to the runner, which feeds them to the
scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import structlog
import trio

from meshagent.engine.base import ModelInfo
from meshagent.engine.runtime import (
    FLASH_ATTN_WINDOWS,
    EmbdItem,
    inexact_build,
    inexact_model,
)
from meshagent.engine.stage import WIRE_DTYPES, StageEngine
from meshagent.engine.vocab import Vocab, VocabDelegate
from meshagent.engine.windows import TEXT
from meshagent.errors import EngineError, SplitUnavailable
from meshagent.models.slicer import TokenEmbeddings
from meshagent.net.outbox import Outbox
from meshagent.serving import stage_messages as sm
from meshagent.serving.awaited import AwaitedWindows
from meshagent.serving.executor import SampledToken
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import TokenLogprob
from meshagent.serving.steps import Step

log = structlog.get_logger(__name__)

STAGE_LABEL = "stage/1"
REPLY_LABEL = "stage-reply/1"
# Frames of hidden states a link may have in flight: the pipeline depth, bounding memory.
ACTIVATION_WINDOW_FRAMES = 8
ACTIVATION_WINDOW_BYTES = 8 * 1024 * 1024
MAX_WINDOWS = 4  # a sequence's draft windows in flight at once


class EntryEngine(VocabDelegate):
    """What the entry agent runs itself: tokenizer, embedding lookup, the first stage."""

    def __init__(
        self,
        entry_artifact: Path,
        first_stage: StageEngine,
        info: ModelInfo,
        weight_types: Sequence[str] = (),
    ) -> None:
        self.vocab = Vocab.load(entry_artifact)
        self.embed = TokenEmbeddings(entry_artifact)
        self.stage = first_stage
        # The chat template and special tokens are the entry artifact's: the agent's own
        # model file may be a partial copy read without its tokenizer (models/ranged.py).
        self.info = replace(
            info,
            n_vocab=self.vocab.n_vocab,
            chat_template=self.vocab.chat_template(),
            bos_token=self.vocab.bos_token,
            eos_token=self.vocab.eos_token,
        )
        self.n_slots = first_stage.n_slots
        self.slot_ctx = first_stage.slot_ctx
        self.end_layer: int | None = first_stage.end  # where the next stage must start
        self.rewindable = first_stage.runtime.rewindable
        # A draft's window computes what one-token steps compute where llama.cpp is built
        # without LLAMAFILE, runs without flash attention or its tiled kernels, and has not
        # repacked the model's weights (`weight_types`, engine/windows.py). Judged by this
        # agent's build and settings; each other stage's agent says in gossip how its own
        # compute (`MeshModel._judge_windows`).
        trouble = (
            (FLASH_ATTN_WINDOWS if first_stage.flash_attn is not False else "")
            or inexact_build()
            or inexact_model(weight_types)
        )
        self.exact_windows = not trouble
        self.windows_reason = "a split: " + (
            trouble or "judged by this agent's llama.cpp build and the model's weight types"
        )

    def run_first(self, items: Sequence[tuple[int, int, list[int]]]) -> list[np.ndarray]:
        """items: (seq, pos, tokens). Returns the first stage's output rows per item."""
        batch = [EmbdItem(seq, pos, self.embed(tokens)) for seq, pos, tokens in items]
        out = self.stage.forward(batch)
        assert out.hidden is not None
        return out.hidden

    def clear_sequence(self, seq_id: int) -> None:
        self.stage.clear_sequence(seq_id)

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        self.stage.trim_sequence(seq_id, keep)

    def export_sequence(self, seq_id: int, keep: int) -> bytes:
        return self.stage.export_sequence(seq_id, keep)

    def import_sequence(self, seq_id: int, state: bytes) -> None:
        self.stage.import_sequence(seq_id, state)

    def memory_bytes(self) -> int:
        return self.stage.memory_bytes()

    def close(self) -> None:
        self.stage.close()
        self.vocab.close()


OpenDownstream = Callable[[], Awaitable[trio.abc.SendStream]]


class PipelineExecutor:
    """Runs steps as the entry of a split: the first stage here, the rest downstream."""

    def __init__(
        self,
        entry: EntryEngine,
        open_downstream: OpenDownstream,
        *,
        wire_dtype: str = "f16",
        depth: int = 1,
        stall_after: float = 20.0,
        prefix_budget: int = 0,
        prefix_scale: float = 1.0,
    ) -> None:
        """`prefix_budget`: bytes of kept prefixes, counted for the biggest stage, whose KV
        per token is `prefix_scale` times the first stage's (every stage keeps its own)."""
        self.entry = entry
        self.prefix_budget = prefix_budget
        self._prefix_scale = prefix_scale
        self.kept_size: Callable[[int], int] | None = None  # measured when `run` starts
        self._kept: dict[int, bytes] = {}  # prefix-cache entry -> the first stage's KV of it
        # Entries below this id were forgotten when a chain broke: a step that restores one
        # was taken before, and its sequences failed with that chain.
        self._stale_below = 0
        # A chain that returns no token for this long while steps wait for one has lost
        # them somewhere (a stage reloaded under them, a message dropped): it is broken, and
        # the requests are replayed, rather than waiting for ever.
        self.stall_after = stall_after
        self._progress_at = 0.0  # when a reply last came, or a step went out to an idle chain
        self.n_slots = entry.n_slots
        self.slot_ctx = entry.slot_ctx
        # Drafts go down the chain as part of a step's rows; the last stage verifies them.
        # A sequence may have several windows in flight: the next goes before the verdict on
        # the last, so drafts are not held to one window per trip around the ring.
        self.speculates = entry.rewindable
        self.max_windows = MAX_WINDOWS if entry.rewindable else 1
        self.exact_windows = entry.exact_windows
        self.windows_reason = entry.windows_reason
        # Per slot, the position after the last token its stages took: a step that starts
        # before it follows a window whose tail was rejected, and the cache is cut back.
        self._ends: dict[int, int] = {}
        self.depth = max(1, depth)
        self._open_downstream = open_downstream
        self._wire = WIRE_DTYPES[wire_dtype]
        self._down: trio.abc.SendStream | None = None
        self._outbox: Outbox | None = None  # sends to _down from the worker's hand-offs
        self._nursery: trio.Nursery | None = None
        # Bumped each time the chain breaks; a reply stream from an older chain is then
        # ignored, whatever it still says.
        self._generation = 0
        self._runner: ModelRunner | None = None
        self._trio: trio.lowlevel.TrioToken | None = None
        self.peak_rounds_in_flight = 0
        self.largest_round = 0  # sequences in the biggest round so far
        self.failed: str | None = None
        # What the last stage may say: tokens of the vocabulary, for the windows in flight.
        self._reply_limits = sm.StageLimits(entry.n_slots, entry.slot_ctx, entry.info.n_vocab)
        self._awaited = AwaitedWindows()  # on the event loop, as sent

    @property
    def prefix_reason(self) -> str:
        if self.prefix_budget <= 0:
            return "off (--prefix-cache 0, or no memory left free by the plan)"
        if not self.speculates:
            return "off: the model's state cannot be cut back to a shared prefix"
        if not self.exact_windows:
            why = self.windows_reason
            return f"off: a prefix computed in other batches would change tokens ({why})"
        return "on"

    def rebudget(self, budget: int) -> None:
        """Keep prefixes within `budget` bytes from now on (the chain's stages changed, and
        with them the room they have for them)."""
        self.prefix_budget = budget
        index = self._runner.scheduler.prefix if self._runner is not None else None
        if index is not None:
            index.budget = budget

    def kept_bytes(self) -> int:
        """Bytes of the first stage's KV kept for prefixes now."""
        return sum(len(b) for b in self._kept.values())

    async def run(self, runner: ModelRunner, *, task_status: trio.TaskStatus[None]) -> None:
        self._runner = runner
        self._trio = trio.lowlevel.current_trio_token()
        if self.prefix_reason == "on":
            self.kept_size = await trio.to_thread.run_sync(self._measure_kept_size)
        async with trio.open_nursery() as nursery:  # the outbox's sends that had to wait
            self._nursery = nursery
            task_status.started()
            try:
                await self._watch_progress(runner)
            finally:
                self._nursery = None
                if self._outbox is not None:
                    self._outbox.close()

    async def _watch_progress(self, runner: ModelRunner) -> None:
        idle = True
        while True:
            await trio.sleep(min(1.0, self.stall_after / 4))
            now = trio.current_time()
            waiting = runner.steps_in_flight() > 0
            if waiting and idle:
                self._progress_at = max(self._progress_at, now - 1.0)
            idle = not waiting
            if waiting and self.failed is None and now - self._progress_at > self.stall_after:
                self._broken(f"no token from the split for {now - self._progress_at:.0f} s")

    def _measure_kept_size(self, slot: int = 0) -> Callable[[int], int]:
        """What a kept prefix of n tokens costs in its biggest stage: the first stage's
        export of two lengths, scaled (see `executor.measure_kept_size`)."""
        tokens = self.entry.tokenize(TEXT, add_bos=True)[:33]
        self.entry.clear_sequence(slot)
        try:
            self.entry.run_first([(slot, 0, tokens)])
            sizes = [len(self.entry.export_sequence(slot, n)) for n in (len(tokens), 1)]
        finally:
            self.entry.clear_sequence(slot)
        per_token = (sizes[0] - sizes[1]) / (len(tokens) - 1) * self._prefix_scale
        fixed = sizes[1] * self._prefix_scale - per_token
        return lambda n: int(fixed + per_token * n + 0.5)

    # ----- the worker thread -----

    def run_step(self, step: Step) -> list[SampledToken]:
        if any(op.restore and op.restore[0] < self._stale_below for op in step.opened):
            # Taken before the chain broke: its sequences failed with that chain, and the
            # stages of the next one hold none of the prefixes it names.
            for slot in step.released:
                self.entry.clear_sequence(slot)
                self._ends.pop(slot, None)
            return []
        # Evicted entries go before the new ones come, here and at every stage, so the kept
        # bytes stay within the budget; only those this step restores or saves wait.
        early, late = step.drops()
        for entry in early:
            self._kept.pop(entry, None)
        for save in step.saves:
            self._kept[save.entry] = self.entry.export_sequence(save.slot, save.tokens)
        for slot in step.released:
            self.entry.clear_sequence(slot)
            self._ends.pop(slot, None)
        for op in step.opened:
            if op.restore is not None:
                entry, keep = op.restore
                self.entry.import_sequence(op.slot, self._kept[entry])
                self.entry.trim_sequence(op.slot, keep)
                self._ends[op.slot] = keep
        for entry in late:
            self._kept.pop(entry, None)
        if self.failed is not None:
            if not step.items:
                return []  # only slots to forget: the stages start afresh on a new chain
            # A request needs the chain: open it again (the stage may be back by now).
            self._on_loop(self._reconnect)
        messages: list[sm.Message] = [sm.Drop(early)] if early else []
        messages += [sm.Keep(x.slot, x.entry, x.tokens) for x in step.saves]
        messages += [sm.Close(slot) for slot in step.released]
        messages += [sm.Open(op.slot, op.sampling, op.history, op.restore) for op in step.opened]
        if late:
            messages.append(sm.Drop(late))
        generation = self._generation
        items: tuple[sm.ForwardItem, ...] = ()
        if step.items:
            t0 = time.perf_counter()
            for it in step.items:
                if self._ends.get(it.slot, it.pos) > it.pos:
                    self.entry.trim_sequence(it.slot, it.pos)
                self._ends[it.slot] = it.pos + len(it.tokens)
            hidden = self.entry.run_first([(it.slot, it.pos, list(it.tokens)) for it in step.items])
            if self.failed is not None or generation != self._generation:
                return []  # the pipeline broke meanwhile; this step's requests failed with it
            first_ms = round((time.perf_counter() - t0) * 1000, 3)
            items = tuple(
                sm.ForwardItem(
                    it.slot,
                    it.pos,
                    len(it.tokens),
                    it.last,
                    tuple(it.tokens[-(it.draft + it.follows) :]) if it.draft or it.follows else (),
                    it.follows,
                )
                for it in step.items
            )
            rows = np.concatenate(hidden).astype(self._wire, copy=False)
            messages.append(sm.Forward(items, rows, (first_ms,), self.entry.end_layer))
            assert self._runner is not None
            rounds = self._runner.steps_in_flight()
            self.peak_rounds_in_flight = max(self.peak_rounds_in_flight, rounds)
            self.largest_round = max(self.largest_round, len(step.items))
        if messages:
            if self._outbox is None:
                self._on_loop(self._open)
            # Not waiting for the send: the event loop sends when it next runs.
            assert self._runner is not None
            data = b"".join(sm.encode(m) for m in messages)
            opened = [op.slot for op in step.opened]
            self._runner.post(self._put, generation, data, step.released, opened, items)
        return []

    def _on_loop(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        trio.from_thread.run(fn, *args, trio_token=self._trio)

    # ----- the event loop -----

    async def _open(self) -> None:
        try:
            if self._down is None:
                self._down = await self._open_downstream()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self._broken(f"the next stage is unreachable: {e}")
        else:
            self._new_outbox()

    def _new_outbox(self) -> None:
        if self._nursery is None:
            raise SplitUnavailable("the model is shutting down")
        assert self._down is not None
        outbox: Outbox

        def lost(error: BaseException) -> None:
            if outbox is self._outbox:  # not an old chain's, after a reconnect
                self._broken(f"the next stage is unreachable: {error}")

        outbox = self._outbox = Outbox(self._down, self._nursery, lost)

    def _put(
        self,
        generation: int,
        data: bytes,
        released: Sequence[int] = (),
        opened: Sequence[int] = (),
        items: Sequence[sm.ForwardItem] = (),
    ) -> None:
        """Send a step's messages, unless the chain they were made for broke meanwhile: a
        new chain must not get a Forward for a sequence it was never told to open. What
        they ask of the last stage is awaited from here on."""
        if generation != self._generation:
            return
        if self._outbox is not None and self.failed is None:  # closed with the executor
            self._awaited.sent(released, opened, items)
            self._outbox.put(data)

    async def _reconnect(self) -> None:
        """After a failure: open a new stream to the next stage (the stages behind it start
        afresh on a new stream), so the split serves again once its peers are back. A
        failure to reopen fails the step that asked (SplitUnavailable)."""
        old, self._down, self._outbox = self._down, None, None
        if old is not None:
            await trio.aclose_forcefully(old)
        try:
            self._down = await self._open_downstream()
        except Exception as e:
            raise SplitUnavailable(
                f"the split pipeline failed: {self.failed}; reconnecting failed: {e}"
            ) from e
        self._new_outbox()
        log.info("pipeline.reconnected", after=self.failed, generation=self._generation)
        self.failed = None

    def interrupt(self, why: str) -> None:
        """The split cannot finish what is in flight (e.g. a stage's peer was declared dead):
        fail those requests now rather than when the transport notices."""
        if self._runner is not None and self._runner.busy():
            self._broken(why)

    def rechain(self, why: str) -> None:
        """The chain changes (its plan was repaired around a lost peer): what is in flight
        fails now, and the next step opens the new chain."""
        self._broken(why)

    def _broken(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            # From here on the chain is history: whatever its streams still say (a late
            # token, its reply stream closing as it tears down) is ignored.
            self._generation += 1
            self._awaited.clear()
            log.error("pipeline.broken", why=why)
        if self._runner is not None:
            # The next chain's stages start without kept prefixes: forget them first, so
            # that no sequence admitted as these fail starts from one.
            self._stale_below = self._runner.forget_prefixes()
            self._runner.fail_all(SplitUnavailable(f"the split pipeline failed: {why}"))

    async def handle_reply(self, stream: trio.abc.ReceiveStream) -> None:
        """Tokens from the last stage; a failure or a lost reply stream fails the waiters."""
        generation = self._generation
        decoder = sm.StageDecoder(self._reply_limits)
        try:
            while data := await stream.receive_some():
                msgs = decoder.feed(data)
                if generation != self._generation:
                    return  # a chain from before a reconnect: nothing it says applies
                self._on_replies(msgs)
        except (sm.StageProtocolError, trio.BrokenResourceError) as e:
            if generation == self._generation:
                self._broken(f"reply stream from the last stage failed: {e}")
            return
        if generation == self._generation:
            self._broken("the last stage closed its reply stream")

    def _on_replies(self, msgs: list[sm.Message]) -> None:
        assert self._runner is not None
        self._progress_at = trio.current_time()
        tokens: list[SampledToken] = []
        for msg in msgs:
            if isinstance(msg, sm.Token):
                if not self._awaited.token(msg):
                    continue  # for a sequence that ended while it was in flight
                lps: list[TokenLogprob | None] = [*msg.logprobs] or [None] * (1 + len(msg.more))
                tokens.append((msg.seq, msg.token, msg.timing, lps[0]))
                # a verified draft
                tokens += [(msg.seq, t, (), lp) for t, lp in zip(msg.more, lps[1:], strict=True)]
            elif isinstance(msg, sm.StageFailure):
                if msg.seq is None:
                    self._broken(msg.message)
                    return
                if self._awaited.failure(msg.seq):
                    self._runner.fail_slot(msg.seq, EngineError(f"a stage failed: {msg.message}"))
            else:
                raise sm.StageProtocolError(f"unexpected {type(msg).__name__} on the reply stream")
        if tokens:
            self._runner.tokens_ready(tokens)
