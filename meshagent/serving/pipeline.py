"""The entry of a split model: tokenizer, embeddings and the first stage on this agent, the
rest of the layers on other peers.

`PipelineExecutor` runs each step's first stage on the runner's worker thread and streams the
hidden states to the next stage, without waiting for the step before it to come back, so
several rounds (different sequences) are in the pipeline at once and the stages compute in
parallel. The scheduler makes that happen: with `depth` stages a step takes at most 1/depth
of the active sequences, so with four requests and three stages each travels as a group of
its own, and while one group is in the second stage another is in the first.

The worker thread computes and encodes; what goes down the chain, and the tokens that come
back straight from the last stage on a reply stream, are the event loop's, in
`serving/chain.py`, which tells the tokens to the runner's sink.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
from meshagent.models.slicer import TokenEmbeddings
from meshagent.serving import stage_messages as sm
from meshagent.serving.chain import Chain, OpenDownstream, Outgoing
from meshagent.serving.executor import NOTHING_YET, WHOLE_PREFIXES, ExecutorSink, StepDone
from meshagent.serving.kv_book import KvBook, measure_kept_size
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
            fim=self.vocab.fim(),
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
        work_scale: float | None = None,
    ) -> None:
        """`prefix_budget`: bytes of kept prefixes, counted for the biggest stage, whose KV
        per token is `prefix_scale` times the first stage's (every stage keeps its own).
        `work_scale`: the whole model's layers over the first stage's (`depth` unless said),
        to tell the chain what a step's rows cost it from the first stage's time."""
        self.entry = entry
        self._work_scale = float(depth) if work_scale is None else work_scale
        self.prefix_budget = prefix_budget
        self._prefix_scale = prefix_scale
        self.kept_size: Callable[[int], int] | None = None  # measured when `run` starts
        self.book = KvBook(entry)  # the first stage's slots and kept prefixes
        self.n_slots = entry.n_slots
        self.slot_ctx = entry.slot_ctx
        # Drafts go down the chain as part of a step's rows; the last stage verifies them.
        # A sequence may have several windows in flight: the next goes before the verdict on
        # the last, so drafts are not held to one window per trip around the ring.
        # A recurrent state is cut back from the checkpoint each stage takes before a window
        # (engine/checkpoints.py): one window of a sequence at a time.
        self.speculates = True
        self.max_windows = MAX_WINDOWS if entry.rewindable else 1
        self.cuts_prefixes = entry.rewindable
        self.exact_windows = entry.exact_windows
        self.windows_reason = entry.windows_reason
        self.depth = max(1, depth)
        self._wire = WIRE_DTYPES[wire_dtype]
        # What the last stage may say: tokens of the vocabulary, for the windows in flight.
        limits = sm.StageLimits(entry.n_slots, entry.slot_ctx, entry.info.n_vocab)
        self.chain = Chain(open_downstream, limits, stall_after=stall_after)

    @property
    def prefix_reason(self) -> str:
        if self.prefix_budget <= 0:
            return "off (--prefix-cache 0, or no memory left free by the plan)"
        if not self.exact_windows:
            why = self.windows_reason
            return f"off: a prefix computed in other batches would change tokens ({why})"
        return "on" if self.cuts_prefixes else WHOLE_PREFIXES

    def kept_bytes(self) -> int:
        """Bytes of the first stage's KV kept for prefixes now."""
        return self.book.kept_bytes()

    async def run(self, sink: ExecutorSink, *, task_status: trio.TaskStatus[None]) -> None:
        if self.prefix_reason in ("on", WHOLE_PREFIXES):
            self.kept_size = await trio.to_thread.run_sync(self._measure_kept_size)
        await self.chain.run(sink, task_status=task_status)

    def _measure_kept_size(self) -> Callable[[int], int]:
        """What a kept prefix of n tokens costs in its biggest stage: the first stage's
        export, scaled (`kv_book.measure_kept_size`)."""
        tokens = self.entry.tokenize(TEXT, add_bos=True)[:33]

        def prefill(slot: int, tokens: list[int]) -> None:
            self.entry.run_first([(slot, 0, tokens)])

        return measure_kept_size(self.entry, prefill, tokens, scale=self._prefix_scale)

    # ----- the worker thread -----

    def run_step(self, step: Step) -> StepDone:
        chain = self.chain
        if any(op.restore and op.restore[0] < chain.stale_below for op in step.opened):
            # Taken before the chain broke: its sequences failed with that chain, and the
            # stages of the next one hold none of the prefixes it names.
            for slot in step.released:
                self.book.release(slot)
            return NOTHING_YET
        # Evicted entries go before the new ones come, here and at every stage, so the kept
        # bytes stay within the budget; only those this step restores or saves wait.
        early, late = step.drops()
        self.book.apply(step)
        messages: list[sm.Message] = [sm.Drop(early)] if early else []
        messages += [sm.Keep(x.slot, x.entry, x.tokens) for x in step.saves]
        messages += [sm.Close(slot) for slot in step.released]
        messages += [sm.Open(op.slot, op.sampling, op.history, op.restore) for op in step.opened]
        if late:
            messages.append(sm.Drop(late))
        generation = chain.generation
        items: tuple[sm.ForwardItem, ...] = ()
        first_ms = 0.0
        if step.items:
            chain.made += 1  # from here the chain counts it on its way (`Chain.pending`)
            t0 = time.perf_counter()
            for it in step.items:
                self.book.take(it.slot, it.pos, len(it.tokens))
            hidden = self.entry.run_first([(it.slot, it.pos, list(it.tokens)) for it in step.items])
            if generation != chain.generation:  # the chain broke meanwhile, and its requests
                return StepDone([], Outgoing(generation, b"", made=True))  # (dropped)
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
        if not messages:
            return NOTHING_YET
        data = b"".join(sm.encode(m) for m in messages)
        opened = tuple(op.slot for op in step.opened)
        work = first_ms / 1000 * self._work_scale  # (none without rows)
        out = Outgoing(generation, data, step.released, opened, items, bool(items), work)
        return StepDone([], out)

    # ----- the event loop -----

    def deliver(self, outgoing: object) -> None:
        assert isinstance(outgoing, Outgoing)
        self.chain.send(outgoing)

    async def handle_reply(self, stream: trio.abc.ReceiveStream) -> None:
        """Tokens from the last stage (`Chain.handle_reply`)."""
        await self.chain.handle_reply(stream)

    def interrupt(self, why: str) -> None:
        """The split cannot finish what is in flight (e.g. a stage's peer was declared dead):
        fail those requests now rather than when the transport notices."""
        self.chain.interrupt(why)

    def rechain(self, why: str) -> None:
        """The chain changes (its plan was repaired around a lost peer): what is in flight
        fails now, and the next step opens the new chain."""
        self.chain.break_(why)
