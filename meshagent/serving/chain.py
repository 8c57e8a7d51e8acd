"""The entry's chain on the event loop: the stream down to the next stage, the reply streams
back from the last, what is awaited on them, and when the chain counts as broken.

A split's entry computes its first stage on the runner's worker thread
(`pipeline.PipelineExecutor.run_step`) and leaves the rest of each step to this chain: an
`Outgoing`, which the runner hands over on the event loop (`send`). The stream down is opened
here, on the loop, when the first step needs it and again after a break; the steps made
meanwhile wait for it. Tokens from the last stage (`handle_reply`) are checked against the
windows sent (`AwaitedWindows`) and told to the runner's sink.

The chain breaks when the stream down or a reply stream fails, the next stage ends the stream
down while something is awaited, the last stage reports a failure of the whole chain, no token
comes for `stall_after` seconds while some are awaited (counted from when the work sent should
be done: see `STALL_MARGIN`), or its owner says so (`interrupt`, `rechain`). Then every request
in flight fails (`ExecutorSink.broken`; the request's own recovery decides what follows, see
`serving/recovery.py`), the chain's generation moves on, and whatever the old chain still says
is ignored; the next step that needs the chain opens a new stream, and the stages behind it
start afresh.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import trio

from meshagent.errors import EngineError, SplitUnavailable
from meshagent.serving import stage_messages as sm
from meshagent.serving.awaited import AwaitedWindows
from meshagent.serving.executor import ExecutorSink, SampledToken
from meshagent.serving.moving import (
    IDLE_QUIET,
    Handover,
    MovingOutbox,
    MovingReader,
    first_messages,
)
from meshagent.serving.sampling import TokenLogprob

log = structlog.get_logger(__name__)

OpenDownstream = Callable[[], Awaitable[trio.abc.SendStream]]

# A step's rows owe the chain some compute before any token can come back: a long prompt's
# chunks, or a replay's history fed a token a step, answer nothing until the last one. The
# stall watch counts from when the work sent should be done, at this many times the pace the
# entry estimates (its own stage's time, scaled to the whole model: `Outgoing.work`).
STALL_MARGIN = 4.0


@dataclass(frozen=True)
class Outgoing:
    """A step's messages for the chain, as the worker made them for chain `generation`; what
    they ask of the last stage (`released`, `opened`, `items`) is awaited once sent."""

    generation: int
    data: bytes
    released: tuple[int, ...] = ()
    opened: tuple[int, ...] = ()
    items: tuple[sm.ForwardItem, ...] = ()
    made: bool = False  # counted in `Chain.made` (a step with items)
    # Seconds the whole chain should take over the step, at the pace of the entry's stage.
    work: float = 0.0


class Chain:
    """The stream down, the reply streams and the breaks of one entry's chain."""

    def __init__(
        self,
        open_downstream: OpenDownstream,
        reply_limits: sm.StageLimits,
        *,
        stall_after: float = 20.0,
    ) -> None:
        self.open_downstream = open_downstream
        self._reply_limits = reply_limits
        # A chain that returns no token for this long while steps wait for one has lost
        # them somewhere (a stage reloaded under them, a message dropped): it is broken, and
        # the requests are replayed, rather than waiting for ever.
        self.stall_after = stall_after
        # Bumped each time the chain breaks: a step made for an older one is not sent, and a
        # reply stream from an older one is ignored, whatever it still says. Read by the
        # worker thread to stamp its steps.
        self.generation = 0
        # Entries below this id were forgotten when a chain broke: a step that restores one
        # was taken before, and its sequences failed with that chain (read by the worker).
        self.stale_below = 0
        self.failed: str | None = None  # why the chain broke, until it is open again
        self._sink: ExecutorSink | None = None
        self._nursery: trio.Nursery | None = None
        self._outbox: MovingOutbox | None = None  # sends down (moving with its connection)
        self._handover = Handover()  # reply streams that carry on one that moved
        self._opening = False  # a task opens the stream down; steps wait in `_waiting`
        self._waiting: list[Outgoing] = []
        self._awaited = AwaitedWindows()
        # Steps with items from the start of their compute to their send: the worker counts
        # them made, the loop counts them sent (each counter written by one thread only).
        self.made = 0
        self._sent = 0
        self._progress_at = 0.0  # when a reply last came, or a step went to an idle chain
        # When the work sent should be done, at `STALL_MARGIN` times the entry's pace.
        self._due_at = 0.0
        self._busy = trio.Event()  # set by the next step to go: the stall watch waits on it

    @property
    def pending(self) -> bool:
        """Some step is on its way down, or some window's token has not come back."""
        return self.made > self._sent or self._awaited.windows > 0

    async def run(self, sink: ExecutorSink, *, task_status: trio.TaskStatus[None]) -> None:
        self._sink = sink
        async with trio.open_nursery() as nursery:  # the outbox's sends, opening the stream
            self._nursery = nursery
            task_status.started()
            try:
                await self._watch_stall()
            finally:
                self._nursery = None
                if self._outbox is not None:
                    self._outbox.close()

    # ----- going down -----

    def send(self, out: Outgoing) -> None:
        """A step's messages: sent now, after the stream down is open, or never (made for a
        chain that broke since, or only slots to forget while no chain is up: the stages of
        the next one start afresh)."""
        if out.made:
            self._sent += 1
        if out.generation != self.generation:
            return
        if self._outbox is not None and self.failed is None:
            self._put(out)
        elif self.failed is None or out.items or self._opening:
            self._wake()  # (the stall watch counts from here, while the stream opens)
            self._waiting.append(out)
            if not self._opening and self._nursery is not None:
                self._opening = True
                self._nursery.start_soon(self._open)

    def _put(self, out: Outgoing) -> None:
        assert self._outbox is not None
        self._wake()
        self._due_at = max(self._due_at, trio.current_time()) + STALL_MARGIN * out.work
        self._awaited.sent(out.released, out.opened, out.items)
        self._outbox.put(out.data)

    async def _open(self) -> None:
        """Open the stream down (again, after a break: the stages behind it start afresh on
        a new stream), then send the steps that waited for it. A failure to open breaks the
        chain: the requests that wanted it fail."""
        old, self._outbox = self._outbox, None
        if old is not None:
            old.close()
            await trio.aclose_forcefully(old.stream)
        try:
            down = await self.open_downstream()
        except Exception as e:
            self._opening = False
            self._waiting.clear()
            self.break_(
                f"{self.failed}; reconnecting failed: {e}"
                if self.failed is not None
                else f"the next stage is unreachable: {e}"
            )
            return
        if self._nursery is None:
            await trio.aclose_forcefully(down)
            return
        outbox: MovingOutbox

        def lost(error: BaseException) -> None:
            if outbox is self._outbox:  # not an old chain's, after a reconnect
                self.break_(f"the next stage is unreachable: {error}")

        self._opening = False
        outbox = self._outbox = MovingOutbox(down, self._nursery, lost, self.open_downstream)
        self._nursery.start_soon(self._watch_down, outbox)
        if self.failed is not None:
            log.info("pipeline.reconnected", after=self.failed, generation=self.generation)
            self.failed = None
        waiting, self._waiting = self._waiting, []
        for out in waiting:
            if out.generation == self.generation:
                self._put(out)

    async def _watch_down(self, outbox: MovingOutbox) -> None:
        """The next stage ends the stream down (it sends nothing on it) only when it stops
        serving it: it failed, or its agent left. What is in flight on it is then lost, and
        the chain breaks now, not at the stall watch's deadline. A stream it moved from, or
        one an older chain opened, is not that."""
        while outbox is self._outbox:
            stream = outbox.stream
            receive = getattr(stream, "receive_some", None)
            if receive is None:  # (a send-only stream, in tests)
                return
            why = "the next stage ended the stream down"
            try:
                while await receive():
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                why = f"{why}: {e}"
            if outbox is self._outbox and stream is outbox.stream:
                self.interrupt(why)  # (nothing awaited: the next step opens a new one)
                return

    async def end_when_idle(self, quiet: float = IDLE_QUIET) -> None:
        """The agent is leaving: end the stream down once no step is on its way and no token
        awaited, and none came for `quiet` seconds (the stage below then ends its own)."""
        while (outbox := self._outbox) is not None and outbox.failed is None:
            if not self.pending and trio.current_time() - self._progress_at >= quiet:
                outbox.close()
                await trio.aclose_forcefully(outbox.stream)
                return
            await trio.sleep(quiet / 4)

    # ----- coming back -----

    async def handle_reply(self, stream: trio.abc.ReceiveStream) -> None:
        """Tokens from the last stage; a failure or a lost reply stream breaks the chain.
        They are read in the chain's own task (the stream's connection may be replaced while
        they come: they then come on the stream that continues this one, which waits here
        for its reader). Returns once this stream's messages are read."""
        generation = self.generation
        decoder = sm.StageDecoder(self._reply_limits)
        try:
            first = await first_messages(stream, decoder)
        except (sm.StageProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._reply_failed(generation, e)
            return
        if first and isinstance(first[0], sm.Continue):
            await self._handover.park(stream, first[0].move, decoder, first[1:])
            return
        if self._nursery is None:
            return
        read = trio.Event()
        reader = MovingReader(stream, decoder, self._handover, first, read=read.set)
        self._nursery.start_soon(self._read_replies, reader, generation)
        await read.wait()

    async def _read_replies(self, reader: MovingReader, generation: int) -> None:
        try:
            while msgs := await reader.receive():
                if generation != self.generation:
                    return  # a chain from before a reconnect: nothing it says applies
                self._on_replies(msgs)
        except (sm.StageProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._reply_failed(generation, e)
            return
        except Exception as e:  # a bug here ends this chain, never the model's runner
            log.exception("pipeline.reply_failed")
            self._reply_failed(generation, e)
            return
        finally:
            reader.close()
        if generation == self.generation:
            self.break_("the last stage closed its reply stream")

    def _reply_failed(self, generation: int, error: BaseException) -> None:
        if generation == self.generation:
            self.break_(f"reply stream from the last stage failed: {error}")

    def _on_replies(self, msgs: list[sm.Message]) -> None:
        assert self._sink is not None
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
                    self.break_(msg.message)
                    return
                if self._awaited.failure(msg.seq):
                    self._sink.failed(msg.seq, EngineError(f"a stage failed: {msg.message}"))
            else:
                raise sm.StageProtocolError(f"unexpected {type(msg).__name__} on the reply stream")
        if tokens:
            self._sink.tokens(tokens)

    # ----- breaking -----

    def _wake(self) -> None:
        if not self._busy.is_set():  # (once per busy spell: the watch then sleeps to deadlines)
            self._busy.set()

    async def _watch_stall(self) -> None:
        """Break the chain when no token came for `stall_after` seconds while some were
        awaited, counted from the last token or from when the work sent should be done,
        whichever is later: woken when a step goes to an idle chain, and at each deadline."""
        while True:
            if not self.pending or self.failed is not None:
                self._busy = trio.Event()
                await self._busy.wait()
                self._progress_at = max(self._progress_at, trio.current_time())
                continue
            deadline = max(self._progress_at, self._due_at) + self.stall_after
            now = trio.current_time()
            if now >= deadline:
                self.break_(f"no token from the split for {now - self._progress_at:.0f} s")
                continue
            await trio.sleep_until(deadline)

    def interrupt(self, why: str) -> None:
        """The chain cannot finish what is in flight (e.g. a stage's peer was declared dead):
        fail those requests now rather than when the transport notices."""
        if self.pending:
            self.break_(why)

    def break_(self, why: str) -> None:
        """The chain is history: every request in flight fails, and nothing its streams
        still say counts."""
        if self.failed is None:
            log.error("pipeline.broken", why=why)
        self.failed = why
        self.generation += 1
        self._due_at = 0.0
        self._awaited.clear()
        if self._sink is not None:
            error = SplitUnavailable(f"the split pipeline failed: {why}")
            self.stale_below = self._sink.broken(error)
