"""Continuous batching: one task owns the engine and runs every active sequence together.

Requests take one of the engine's slots (first come, first served; a bounded queue past
that), feed tokens, and get logits back. Each round the batcher packs one decode token per
decoding sequence plus chunks of pending prompts into one `Engine.forward` call, run off the
event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
import structlog
import trio

from meshagent.engine.base import Engine, ForwardItem
from meshagent.errors import ContextOverflow, EngineError, QueueFull, ShuttingDown
from meshagent.serving.sampling import SamplingParams

log = structlog.get_logger(__name__)

# After handing out logits the batcher waits this long at most for their owners to submit
# the next token, so that decoding sequences keep running in the same batch.
_REGROUP_WAIT = 0.005


@dataclass
class BatcherStats:
    active: int
    queued: int
    slots: int
    max_queue: int
    tokens_processed: int
    batches: int


class Sequence:
    """One request's hold on an engine slot. Positions advance as tokens are fed."""

    def __init__(self, batcher: Batcher, slot: int, sampling: SamplingParams | None) -> None:
        self._batcher = batcher
        self.slot = slot
        self.sampling = sampling
        self.opened = False  # a pipeline has told its stages about this sequence
        self.stage_ms: list[float] = []  # a pipeline's time per stage on this sequence
        self.round = -1  # the pipeline round that last carried this sequence
        self.n_past = 0
        self.closed = False
        self._pending: list[int] = []
        self._result: np.ndarray | int | None = None
        self._error: BaseException | None = None
        self._ready = trio.Event()

    @property
    def capacity(self) -> int:
        return self._batcher.engine.slot_ctx

    async def feed(self, tokens: list[int]) -> np.ndarray | int:
        """Run `tokens` after those fed so far; return the logits of the last one (or, from a
        pipeline whose last stage samples, the next token)."""
        if not tokens:
            raise ValueError("feed needs at least one token")
        if self.n_past + len(tokens) > self.capacity:
            raise ContextOverflow(
                f"sequence needs {self.n_past + len(tokens)} tokens of context, "
                f"the slot holds {self.capacity}",
                prompt_tokens=self.n_past + len(tokens),
                limit=self.capacity,
            )
        if self._batcher.aborted is not None:
            raise EngineError(self._batcher.aborted)
        self._pending = list(tokens)
        self._result = None
        self._error = None
        self._ready = trio.Event()
        self._batcher._submit(self)
        await self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Batcher:
    def __init__(self, engine: Engine, *, max_queue: int, max_batch_tokens: int = 512) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self._free_slots = list(range(engine.n_slots - 1, -1, -1))
        self._slots = trio.Semaphore(engine.n_slots)  # FIFO: trio wakes waiters in order
        self._queued = 0
        self._runnable: list[Sequence] = []
        self._awaiting: set[Sequence] = set()  # got logits, next token not yet submitted
        self._released: list[Sequence] = []
        self._wakeup = trio.Event()
        self._closed = False
        self.aborted: str | None = None
        self._rotate = 0
        self._tokens = 0
        self._batches = 0

    def stats(self) -> BatcherStats:
        return BatcherStats(
            active=self.engine.n_slots - len(self._free_slots),
            queued=self._queued,
            slots=self.engine.n_slots,
            max_queue=self.max_queue,
            tokens_processed=self._tokens,
            batches=self._batches,
        )

    def close(self) -> None:
        """Refuse new sequences; those holding or waiting for a slot carry on."""
        self._closed = True

    def abort(self, reason: str) -> None:
        """Stop for good: every sequence waiting for a step fails with `reason`."""
        self._closed = True
        self.aborted = reason
        self._fail(self._waiting(), EngineError(reason))

    def _waiting(self) -> list[Sequence]:
        return list(self._runnable)

    @asynccontextmanager
    async def sequence(self, sampling: SamplingParams | None = None) -> AsyncIterator[Sequence]:
        """Hold a slot for one request. Raises QueueFull when the wait queue is at its bound.
        `sampling` is for engines that sample remotely (a pipeline's last stage)."""
        if self._closed:
            raise ShuttingDown("the agent is shutting down and takes no new requests")
        if self._slots.value == 0 and self._queued >= self.max_queue:
            raise QueueFull(
                f"all {self.engine.n_slots} slots are busy and {self._queued} requests "
                "are queued; retry shortly"
            )
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        seq = Sequence(self, self._free_slots.pop(), sampling)
        try:
            yield seq
        finally:
            # The slot goes back from the batcher's loop: a forward using it may be running.
            seq.closed = True
            self._awaiting.discard(seq)
            self._released.append(seq)
            self._poke()

    def _forget(self, seq: Sequence) -> None:
        """A released sequence leaves the engine (pipelines tell their stages)."""

    def _submit(self, seq: Sequence) -> None:
        self._awaiting.discard(seq)
        self._runnable.append(seq)
        self._poke()

    def _poke(self) -> None:
        self._wakeup.set()

    def _reclaim(self) -> None:
        for seq in self._released:
            if seq in self._runnable:
                self._runnable.remove(seq)
            self._forget(seq)
            self.engine.clear_sequence(seq.slot)
            self._free_slots.append(seq.slot)
            self._slots.release()
        self._released.clear()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._reclaim()
            if self._awaiting:
                with trio.move_on_after(_REGROUP_WAIT):
                    while self._awaiting:
                        await self._wait()
                self._awaiting.clear()
                continue
            if not self._runnable:
                await self._wait()
                continue
            await self._round()

    async def _wait(self) -> None:
        self._wakeup = trio.Event()
        await self._wakeup.wait()

    def _take_batch(self) -> list[tuple[Sequence, int]]:
        """This round's work: decoding sequences (one token pending) first, then prompt
        chunks in turn, within the token budget. Returns (sequence, tokens to take)."""
        n = len(self._runnable)
        self._rotate = (self._rotate + 1) % max(n, 1)
        order = self._runnable[self._rotate :] + self._runnable[: self._rotate]
        order.sort(key=lambda s: len(s._pending) > 1)
        budget = self.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in order:
            if budget == 0:
                break
            take = min(len(seq._pending), budget)
            batch.append((seq, take))
            budget -= take
        return batch

    def _advance(self, seq: Sequence, take: int) -> bool:
        """Account for `take` tokens of `seq` having run; True when its pending input is done
        (it leaves the runnable list)."""
        self._tokens += take
        seq.n_past += take
        del seq._pending[:take]
        if seq._pending:
            return False
        self._runnable.remove(seq)
        return True

    def _deliver(self, seq: Sequence, result: np.ndarray | int) -> None:
        if seq.closed:
            return
        seq._result = result
        self._awaiting.add(seq)
        seq._ready.set()

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        for seq in seqs:
            if seq in self._runnable:
                self._runnable.remove(seq)
            seq._error = error
            seq._ready.set()

    async def _round(self) -> None:
        batch = self._take_batch()
        items = [
            ForwardItem(seq.slot, seq.n_past, seq._pending[:take], take == len(seq._pending))
            for seq, take in batch
        ]
        try:
            results = await trio.to_thread.run_sync(self.engine.forward, items)
        except Exception as e:  # an engine failure fails this batch's requests, not the agent
            log.error("engine.forward_failed", error=str(e), sequences=len(items))
            self._fail([seq for seq, _ in batch], EngineError(f"inference failed: {e}"))
            return
        self._batches += 1
        for (seq, take), logits in zip(batch, results, strict=True):
            if self._advance(seq, take):
                assert logits is not None
                self._deliver(seq, logits)
