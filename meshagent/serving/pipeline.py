"""The entry of a split model: tokenizer, embeddings and the first stage on this agent, the
rest of the layers on other peers.

`PipelineBatcher` keeps the slots, queue and continuous batching of `Batcher`; each round it
runs the first stage locally and streams the hidden states to the next stage, without waiting
for the round before it to come back, so several rounds (different sequences) are in the
pipeline at once and the stages compute in parallel. To make that happen, a round takes at
most 1/depth of the active sequences (depth = the number of stages): with four requests and
three stages, two groups of two take turns, and while one group is in the second stage the
other is in the first. Tokens come back straight from the last stage on a reply stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog
import trio

from meshagent.engine.base import ModelInfo
from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import WIRE_DTYPES, StageEngine
from meshagent.engine.vocab import Vocab, VocabDelegate
from meshagent.errors import EngineError, SplitUnavailable
from meshagent.models.slicer import TokenEmbeddings
from meshagent.serving import stage_messages as sm
from meshagent.serving.batcher import Batcher
from meshagent.serving.batcher import Sequence as Seq
from meshagent.serving.sampling import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)

log = structlog.get_logger(__name__)

STAGE_LABEL = "stage/1"
REPLY_LABEL = "stage-reply/1"
# Frames of hidden states a link may have in flight: the pipeline depth, bounding memory.
ACTIVATION_WINDOW_FRAMES = 8
ACTIVATION_WINDOW_BYTES = 8 * 1024 * 1024


class EntryEngine(VocabDelegate):
    """What the entry agent runs itself: tokenizer, embedding lookup, the first stage."""

    def __init__(
        self,
        entry_artifact: Path,
        first_stage: StageEngine,
        info: ModelInfo,
    ) -> None:
        self.vocab = Vocab.load(entry_artifact)
        self.embed = TokenEmbeddings(entry_artifact)
        self.stage = first_stage
        self.info = info
        self.n_slots = first_stage.runtime.slots
        self.slot_ctx = first_stage.slot_ctx

    def run_first(self, items: Sequence[tuple[int, int, list[int]]]) -> list[np.ndarray]:
        """items: (seq, pos, tokens). Returns the first stage's output rows per item."""
        batch = [EmbdItem(seq, pos, self.embed(tokens)) for seq, pos, tokens in items]
        out = self.stage.forward(batch)
        assert out.hidden is not None
        return out.hidden

    def clear_sequence(self, seq_id: int) -> None:
        self.stage.clear_sequence(seq_id)

    def memory_bytes(self) -> int:
        return self.stage.memory_bytes()

    def close(self) -> None:
        self.stage.close()
        self.vocab.close()


class PipelineBatcher(Batcher):
    def __init__(
        self,
        engine: EntryEngine,
        open_downstream: object,
        *,
        max_queue: int,
        wire_dtype: str = "f16",
        max_batch_tokens: int = 512,
        depth: int = 1,
    ) -> None:
        super().__init__(engine, max_queue=max_queue, max_batch_tokens=max_batch_tokens)  # type: ignore[arg-type]
        self.entry = engine
        self.depth = max(1, depth)
        self._open_downstream = open_downstream  # async () -> stream to the second stage
        self._wire = WIRE_DTYPES[wire_dtype]
        self._down: trio.abc.SendStream | None = None
        # Bumped each time the stream to the next stage is opened again after a failure; a
        # reply stream from an older chain is then ignored, whatever it still says.
        self._generation = 0
        self._send_lock = trio.Lock()
        self._in_flight: dict[int, Seq] = {}  # slot -> sequence waiting for its token
        self._pending_closes: list[int] = []  # released slots the stages must forget
        self.peak_rounds_in_flight = 0
        self.largest_round = 0  # sequences in the biggest round so far
        self.failed: str | None = None

    async def _downstream(self) -> trio.abc.SendStream:
        if self._down is None:
            self._down = await self._open_downstream()  # type: ignore[operator]
        return self._down

    async def _send(self, messages: list[sm.Message]) -> None:
        data = b"".join(sm.encode(m) for m in messages)
        async with self._send_lock:
            stream = await self._downstream()
            await stream.send_all(data)

    def _take_batch(self) -> list[tuple[Seq, int]]:
        """The base batcher's choice, cut to this round's share of the active sequences: at
        most 1/depth of them, so that at least `depth` groups are in the pipeline (one per
        stage, or more) whenever there are that many sequences. Fewer, bigger groups batch
        better but leave stages idle while a group is elsewhere; on the 3-stage benchmark,
        four requests as four groups of one beat two groups of two by about 7%."""
        batch = super()._take_batch()
        active = len(self._runnable) + len(self._in_flight)
        share = max(1, active // self.depth)
        return batch[:share]

    def _forget(self, seq: Seq) -> None:
        self._in_flight.pop(seq.slot, None)
        if seq.opened and self.failed is None:
            self._pending_closes.append(seq.slot)

    async def _reconnect(self) -> None:
        """After a failure: open a new stream to the next stage (the stages behind it start
        afresh on a new stream), so the split serves again once its peers are back. Raises
        what opening raises."""
        old, self._down = self._down, None
        if old is not None:
            await trio.aclose_forcefully(old)
        self._down = await self._open_downstream()  # type: ignore[operator]
        self._generation += 1
        log.info("pipeline.reconnected", after=self.failed, generation=self._generation)
        self.failed = None

    def interrupt(self, why: str) -> None:
        """The split cannot finish what is in flight (e.g. a stage's peer was declared dead):
        fail those requests now rather than when the transport notices."""
        if self._in_flight:
            self._broken(why)

    async def _round(self) -> None:
        if self.failed is not None:
            try:
                await self._reconnect()
            except Exception as e:
                self._fail(
                    list(self._runnable),
                    SplitUnavailable(
                        f"the split pipeline failed: {self.failed}; reconnecting failed: {e}"
                    ),
                )
                return
        messages: list[sm.Message] = [sm.Close(s) for s in self._pending_closes]
        self._pending_closes.clear()
        batch = self._take_batch()
        for seq, _ in batch:
            if not seq.opened:
                messages.append(sm.Open(seq.slot, seq.sampling or _GREEDY))
                seq.opened = True
        items = [(seq.slot, seq.n_past, list(seq._pending[:take])) for seq, take in batch]
        t0 = trio.current_time()
        generation = self._generation
        try:
            hidden = await trio.to_thread.run_sync(self.entry.run_first, items)
        except Exception as e:
            log.error("pipeline.first_stage_failed", error=str(e))
            self._fail([seq for seq, _ in batch], EngineError(f"inference failed: {e}"))
            return
        if self.failed is not None or generation != self._generation:
            return  # the pipeline broke meanwhile; this batch's requests were failed with it
        fwd_items = []
        for seq, take in batch:
            done = take == len(seq._pending)
            fwd_items.append(sm.ForwardItem(seq.slot, seq.n_past, take, done))
        first_ms = round((trio.current_time() - t0) * 1000, 3)
        messages.append(
            sm.Forward(
                tuple(fwd_items),
                np.concatenate(hidden).astype(self._wire, copy=False),
                (first_ms,),
            )
        )
        for seq, take in batch:
            if self._advance(seq, take):
                self._in_flight[seq.slot] = seq
                seq.round = self._batches
        rounds = len({seq.round for seq in self._in_flight.values()})
        self.peak_rounds_in_flight = max(self.peak_rounds_in_flight, rounds)
        self.largest_round = max(self.largest_round, len(batch))
        self._batches += 1
        try:
            await self._send(messages)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            self._broken(f"the next stage is unreachable: {e}")

    def _waiting(self) -> list[Seq]:
        return list(self._runnable) + list(self._in_flight.values())

    def _broken(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.error("pipeline.broken", why=why)
        waiting = list(self._in_flight.values()) + list(self._runnable)
        self._in_flight.clear()
        self._fail(waiting, SplitUnavailable(f"the split pipeline failed: {why}"))

    async def handle_reply(self, stream: trio.abc.ReceiveStream) -> None:
        """Tokens from the last stage; a failure or a lost reply stream fails the waiters."""
        generation = self._generation
        decoder = sm.StageDecoder()
        try:
            while data := await stream.receive_some():
                for msg in decoder.feed(data):
                    if generation != self._generation:
                        return  # a chain from before a reconnect: nothing it says applies
                    self._on_reply(msg)
        except (sm.StageProtocolError, trio.BrokenResourceError) as e:
            if generation == self._generation:
                self._broken(f"reply stream from the last stage failed: {e}")
            return
        if generation == self._generation:
            self._broken("the last stage closed its reply stream")

    def _on_reply(self, msg: sm.Message) -> None:
        if isinstance(msg, sm.Token):
            seq = self._in_flight.pop(msg.seq, None)
            if seq is not None:
                if len(seq.stage_ms) < len(msg.timing):
                    seq.stage_ms += [0.0] * (len(msg.timing) - len(seq.stage_ms))
                for i, ms in enumerate(msg.timing):
                    seq.stage_ms[i] += ms
                self._deliver(seq, msg.token)
                self._poke()
        elif isinstance(msg, sm.StageFailure):
            if msg.seq is None:
                self._broken(msg.message)
            else:
                seq = self._in_flight.pop(msg.seq, None)
                if seq is not None:
                    self._fail([seq], EngineError(f"a stage failed: {msg.message}"))
        else:
            raise sm.StageProtocolError(f"unexpected {type(msg).__name__} on the reply stream")
