"""A stage after the first: hidden states in from upstream, out to the next stage, or (the
last stage) sampled tokens straight back to the entry."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial

import numpy as np
import structlog
import trio

from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import StageEngine
from meshagent.net.errors import reset_reasons
from meshagent.serving import stage_messages as sm
from meshagent.serving.drafting import verify
from meshagent.serving.executor import new_sampler
from meshagent.serving.kv_book import KeptPrefixError, KvBook
from meshagent.serving.moving import (
    IDLE_QUIET,
    Handover,
    MovingOutbox,
    MovingReader,
    first_messages,
    reset,
)
from meshagent.serving.sampling import Sampler

log = structlog.get_logger(__name__)

OpenStream = Callable[[], Awaitable[trio.abc.SendStream]]
# Kept prefixes a stage holds at most, whatever their bytes: the entry keeps whole
# conversations (16 tokens at least), so a legitimate one reaches this only with a prefix
# budget of gigabytes on a tiny model; each costs a few hundred bytes besides its KV.
MAX_KEPT = 65536


class StageServer:
    """Serves one upstream stream at a time for one stage of one plan. Hidden states go on in
    the dtype they came in: the entry chooses the wire dtype for the whole chain.

    `open_next` opens the stream to the next stage (middle stages); `open_reply` opens the
    reply stream to the entry (the last stage). Every message is checked against this stage's
    slots, their context, the model's `n_vocab` and its hidden width where it is decoded; the
    kept prefixes the entry asks for may take `kept_budget` bytes and `max_kept` entries at
    most. A message past any of them ends the stream with a protocol error, never the agent.
    """

    def __init__(
        self,
        engine: StageEngine,
        *,
        n_vocab: int,
        kept_budget: int,
        open_next: OpenStream | None,
        open_reply: OpenStream | None,
        max_kept: int = MAX_KEPT,
    ) -> None:
        if (open_next is None) == (open_reply is None):
            raise ValueError("a stage sends either to the next stage or back to the entry")
        self.engine = engine
        self.limits = sm.StageLimits(engine.n_slots, engine.slot_ctx, n_vocab, engine.n_embd)
        self._open_next = open_next
        self._open_reply = open_reply
        # Keyed by sequence ids checked against the slots: at most one per slot.
        self._samplers: dict[int, Sampler] = {}
        # The slots' KV and the kept prefixes: the entry decides what is kept and freed
        # (`Keep`, `Drop`), within `kept_budget` bytes and `max_kept` entries; a new upstream
        # stream starts without any.
        self.book = KvBook(engine, budget=kept_budget, max_kept=max_kept, holder="this stage")
        # The last stage, per sequence: the token its last window ended with, where every
        # draft in it was right (a window that follows must have guessed it).
        self._carry: dict[int, int] = {}
        self._serving: trio.CancelScope | None = None  # the upstream stream served now
        self._handover = Handover()  # streams that carry on the one served, once it moved
        self._nursery: trio.Nursery | None = None  # where the chain is served (`run`)
        self._run_scope: trio.CancelScope | None = None
        self._engine_lock = trio.Lock()  # held by the stream served, its worker included
        self._closed = False
        self.forwards = 0
        self._active_at = 0.0  # when the stream served last brought or sent a message
        self._room: trio.Semaphore | None = None  # its batches not handed back yet

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Where the chain is served while this runs (until `aclose`): not in the task of
        the stream it came on, whose connection may be replaced while the chain goes on.
        Without it, each upstream stream is served in its own task, and cannot move."""
        with trio.CancelScope() as scope:
            self._run_scope = scope
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        self._nursery = None

    async def handle(self, upstream: trio.abc.ReceiveStream) -> None:
        """Serve an upstream stream. One that carries on the stream served (its connection
        was replaced) waits for that one's reader. Any other new one starts the chain afresh
        (the entry reconnected after a failure): the stream before it is served no more, and
        no sequence of it may leave its cache behind. Returns once its messages are read."""
        if self._closed:
            return
        decoder = sm.StageDecoder(self.limits)
        first: list[sm.Message] = []
        error = None  # a bad first message is served like any other: the entry hears why
        try:
            first = await first_messages(upstream, decoder)
        except sm.StageProtocolError as e:
            error = e
        if first and isinstance(first[0], sm.Continue):
            await self._handover.park(upstream, first[0].move, decoder, first[1:])
            return
        if self._closed or not (first or error):
            return
        if self._nursery is None:
            await self._serve_chain(MovingReader(upstream, decoder, self._handover, first, error))
            return
        read = trio.Event()  # the reader is done with this stream (moved on, or ended)
        reader = MovingReader(upstream, decoder, self._handover, first, error, read.set)
        self._nursery.start_soon(self._serve_here, reader)
        await read.wait()

    async def _serve_chain(self, upstream: MovingReader) -> None:
        # The old stream's worker finishes its running forward first.
        if self._serving is not None:
            self._serving.cancel()
        scope = self._serving = trio.CancelScope()
        try:
            with scope:
                async with self._engine_lock:
                    if self._closed:
                        return
                    self.book.reset(self.engine.n_slots)
                    self._samplers.clear()
                    self._carry.clear()
                    await self._serve(upstream)
        finally:
            upstream.close()

    async def _serve_here(self, upstream: MovingReader) -> None:
        """`_serve_chain` in this server's own task: what ends it is reported here, as the
        stream's handler would (a reset is routine), and never ends the server."""
        try:
            await self._serve_chain(upstream)
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as group:
            # The peer went or gave up (a reset), or the stream's connection ended under it.
            why = reset_reasons(group) or repr(group.exceptions[0])
            log.info("stage.upstream_ended", reason=why)
        except* Exception as group:
            log.error("stage.serve_failed", exc_info=group)
            reset(upstream.stream, f"stage failed: {group.exceptions[0]!r}")

    async def end_when_idle(self, quiet: float = IDLE_QUIET) -> None:
        """The agent is leaving: serve no more once the stream served is idle (nothing came
        or went on it for `quiet` seconds, no batch is computing). Until then it is served as
        before, while the mesh moves the plan off this agent. The stream it sends on ends
        with it, and the peer upstream learns that it ended."""
        while self._serving is not None:
            room = self._room
            idle = room is None or room.value > 0
            if idle and trio.current_time() - self._active_at >= quiet:
                self._closed = True
                self._serving.cancel()
                return
            await trio.sleep(quiet / 4)

    async def aclose(self) -> None:
        """Serve no more: the stream served now ends (its running forward finishes first)
        and no other starts. After this the engine may be freed."""
        self._closed = True
        if self._serving is not None:
            self._serving.cancel()
        async with self._engine_lock:
            pass
        if self._run_scope is not None:
            self._run_scope.cancel()

    async def _serve(self, upstream: MovingReader) -> None:
        """Messages are decoded here, run in order on a worker thread of this stream (one
        batch at a time, the next one decoded meanwhile), and the worker's bytes go on
        through an `Outbox` straight from its hand-back: no task wakes for them. Both the
        stream in and the stream out move when their connection is replaced."""
        reopen = self._open_next or self._open_reply
        assert reopen is not None
        out = await reopen()
        jobs: queue.SimpleQueue[list[sm.Message] | sm.StageProtocolError | None]
        jobs = queue.SimpleQueue()
        stop = threading.Event()  # set: the worker skips what is still queued
        token = trio.lowlevel.current_trio_token()
        room = trio.Semaphore(1)  # batches handed to the worker and not yet back
        reading = trio.CancelScope()

        peer = getattr(upstream.stream, "peer_id", None)  # a mesh stream's, not in-process ones

        self._room = room

        def done(data: bytes, error: BaseException | None) -> None:  # on the event loop
            self._active_at = trio.current_time()
            room.release()
            outbox.put(data)
            if error is not None:
                if isinstance(error, sm.StageProtocolError):
                    log.warning("stage.protocol_error", error=str(error), peer=peer)
                else:
                    log.error("stage.forward_failed", error=str(error))
                stop.set()
                reading.cancel()

        def work() -> None:  # the worker thread
            while (job := jobs.get()) is not None and not stop.is_set():
                try:
                    data, error = self._run(job), None
                except sm.StageProtocolError as e:
                    data, error = sm.encode(sm.StageFailure(None, f"protocol error: {e}")), e
                except Exception as e:
                    data, error = b"", e
                token.run_sync_soon(done, data, error)

        def lost(error: BaseException) -> None:
            log.warning("stage.downstream_lost", error=str(error))
            stop.set()
            reading.cancel()

        try:
            async with trio.open_nursery() as nursery:
                outbox = MovingOutbox(out, nursery, lost, reopen)
                nursery.start_soon(partial(trio.to_thread.run_sync, work))
                try:
                    with reading:
                        while True:
                            try:
                                msgs: list[sm.Message] | sm.StageProtocolError
                                msgs = await upstream.receive()
                            except sm.StageProtocolError as e:
                                msgs = e
                            if not msgs:
                                break
                            self._active_at = trio.current_time()
                            try:  # no scheduler pass before the worker has its job
                                room.acquire_nowait()
                            except trio.WouldBlock:
                                await room.acquire()
                            jobs.put(msgs)
                            if isinstance(msgs, sm.StageProtocolError):
                                break
                except BaseException:
                    stop.set()  # cancelled (superseded, or the agent stops): drop the rest
                    raise
                finally:
                    jobs.put(None)
                    outbox.stop_watching()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await outbox.stream.aclose()

    def _run(self, msgs: list[sm.Message] | sm.StageProtocolError) -> bytes:
        """One batch of messages, in order, on the worker thread; the bytes to send on."""
        if isinstance(msgs, sm.StageProtocolError):
            raise msgs
        try:
            return self._run_checked(msgs)
        except KeptPrefixError as e:  # the entry asked for more than this stage holds
            raise sm.StageProtocolError(str(e)) from e

    def _run_checked(self, msgs: list[sm.Message]) -> bytes:
        out: list[sm.Message] = []
        i = 0
        while i < len(msgs):
            msg = msgs[i]
            if isinstance(msg, sm.Forward):
                # Forwards that arrived together run as one batch, unless two carry the same
                # sequence: its tokens then run in the batches the entry made, as they would
                # in the whole model (a batch's shape shows in llama.cpp's last bits).
                # Together they stay within what one forward of the engine takes.
                group, seqs, rows = [msg], {it.seq for it in msg.items}, len(msg.hidden)
                while i + 1 < len(msgs) and isinstance(nxt := msgs[i + 1], sm.Forward):
                    if any(it.seq in seqs for it in nxt.items):
                        break
                    if rows + len(nxt.hidden) > self.engine.max_batch_tokens:
                        break
                    seqs.update(it.seq for it in nxt.items)
                    rows += len(nxt.hidden)
                    group.append(nxt)
                    i += 1
                out += self._forward(group)
            elif isinstance(msg, sm.Open):
                if msg.restore is not None:
                    # One this stage does not hold breaks the chain (the entry then forgets
                    # every prefix and replays).
                    self.book.restore(msg.seq, *msg.restore)
                if self.engine.last:
                    self._samplers[msg.seq] = new_sampler(self.engine, msg.sampling, msg.history)
                    self._carry.pop(msg.seq, None)
                else:
                    out.append(msg)
            elif isinstance(msg, sm.Keep):
                self.book.keep(msg.entry, msg.seq, msg.length)
                if not self.engine.last:
                    out.append(msg)
            elif isinstance(msg, sm.Drop):
                self.book.drop(msg.entries)
                if not self.engine.last:
                    out.append(msg)
            elif isinstance(msg, sm.Close):
                self.book.release(msg.seq)
                self._samplers.pop(msg.seq, None)
                self._carry.pop(msg.seq, None)
                if not self.engine.last:
                    out.append(msg)
            elif isinstance(msg, sm.StageFailure):
                # A middle stage stopped on a bad message: its reason goes on to the entry.
                raise sm.StageProtocolError(f"an earlier stage stopped: {msg.message}")
            else:
                raise sm.StageProtocolError(f"unexpected {type(msg).__name__} from upstream")
            i += 1
        return b"".join(sm.encode(m) for m in out)

    @property
    def kept_budget(self) -> int:
        assert self.book.budget is not None
        return self.book.budget

    def kept_bytes(self) -> int:
        return self.book.kept_bytes()

    def _forward(self, group: list[sm.Forward]) -> list[sm.Message]:
        start = self.engine.start
        for f in group:
            if f.layer is not None and start is not None and f.layer != start:
                raise sm.StageProtocolError(
                    f"hidden states for layer {f.layer} reached the stage starting at layer "
                    f"{start}: the two follow different plans"
                )
        items: list[sm.ForwardItem] = [it for f in group for it in f.items]
        rows = np.concatenate([f.hidden for f in group])
        batch, at = [], 0
        for it in items:
            self.book.take(it.seq, it.pos, it.n)  # (a draft's rejected tail goes)
            want = len(it.draft) + (not it.follows) if it.sample and self.engine.last else 0
            batch.append(EmbdItem(it.seq, it.pos, rows[at : at + it.n], want))
            at += it.n
        t0 = time.perf_counter()
        result = self.engine.forward(batch)
        self.forwards += 1
        # Batches run together share this stage's time; earlier stages' times come along.
        upstream = max((f.timing for f in group), key=len)
        timing = (*upstream, round((time.perf_counter() - t0) * 1000, 3))
        if not self.engine.last:
            assert result.hidden is not None
            # Onwards in the dtype the entry chose (the widest, should a batch mix two).
            wire = np.result_type(*(f.hidden.dtype for f in group))
            hidden = np.concatenate(result.hidden).astype(wire, copy=False)
            return [sm.Forward(tuple(items), hidden, timing, self.engine.end)]
        out: list[sm.Message] = []
        for it, logits in zip(items, result.logits, strict=True):
            if not it.sample:
                continue
            sampler = self._samplers.get(it.seq)
            if sampler is None or logits is None:
                out.append(sm.StageFailure(it.seq, f"sequence {it.seq} was never opened"))
                continue
            draft = it.draft
            if it.follows:
                # Sent before the verdict on the window before it, guessing that one's last
                # token: void if that window ended otherwise (the entry knows it too).
                if self._carry.get(it.seq) != draft[0]:
                    self._carry.pop(it.seq, None)
                    continue
                draft = draft[1:]
            # The window: keep what plain decoding would have sampled (with no draft, the one
            # token; the entry stops at an end of generation, the stages cut the rest at the
            # next step). One row of logits comes alone, several stacked.
            rows = list(logits) if draft else [logits]
            tokens = verify(sampler, rows, draft)
            lps = tuple(sampler.take_logprobs())
            out.append(sm.Token(it.seq, tokens[0], timing, tuple(tokens[1:]), lps))
            if len(tokens) == len(draft) + 1:  # all of it right: a window may follow
                self._carry[it.seq] = tokens[-1]
            else:
                self._carry.pop(it.seq, None)
        return out
