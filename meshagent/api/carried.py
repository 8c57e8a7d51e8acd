"""One generation carried to the entries of the mesh from the agent that holds its client (the
asker), over `gen/1` (docs/protocol.md 11.1), so that it survives losing its entry.

The asker sends the request (`Ask`); the entry answers with a `Head` (its receipt, the model's
name, the seed it samples with, the prompt's length) or a `Fail`, then streams the generation's
events, each `Delta` with the token ids behind its text. When the entry is lost (its stream
breaks, or it answers a `Fail` marked resumable: it is shutting down, or the mesh moved the
model), the asker asks the entry that serves the model next, or serves it itself if the mesh
moved the model here, with the same request plus a continuation: the tokens so far, the
characters delivered and the seed. The client sees one stream: the text an undisturbed run
gives, greedy or seeded. Past the deadline with no entry, the request fails as temporarily
unavailable. An asker waits `HEAD_DEADLINE` at most for an entry's first message. The
request's `Recovery` (`serving/recovery.py`) holds the deadline, the tries and the reason, and
wakes the search for the next entry on the directory's changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import structlog
import trio

from meshagent.api import errors
from meshagent.api.errors import ApiError, api_error_for
from meshagent.api.gen_messages import Ask, Fail, Head, Message, Moved, encode
from meshagent.api.gen_moves import Rejoiner, new_ticket
from meshagent.api.gen_stream import Broken, frames, read_message
from meshagent.api.here import Continuation, generating
from meshagent.api.prepare import Prepared
from meshagent.errors import ContextOverflow, MeshError, OutOfRange
from meshagent.serving.directory import GENERATE_LABEL, ModelDirectory, RemoteModel
from meshagent.serving.generation import Delta, Finished, check_fits, check_history
from meshagent.serving.recovery import GaveUp, Recovery
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)

HEAD_DEADLINE = 30.0  # seconds for the entry's head or fail once the ask is sent

Emit = Callable[[Delta | Finished], None]  # where the generation's events go


@dataclass
class Carried:
    """One generation carried to entries of the mesh. `start` asks the first entry and returns
    its `Head`; `run` then emits the events until `Finished`, continuing on another entry when
    one is lost, and raises `ApiError` when the generation fails. `hand_on` continues one
    begun on this agent. Close it with `aclose`."""

    directory: ModelDirectory
    ask: Ask
    name: str  # the model requested
    deadline: float  # seconds to find a new entry after a loss
    # The request prepared on this agent, if it serves the model itself now.
    local: Callable[[], Prepared | None]
    entry: str = ""  # the peer serving the request now
    _entry_label: str = ""  # ... as messages name it
    history: list[int] = field(default_factory=list)
    delivered: int = 0
    prompt_tokens: int = 0
    _stream: trio.abc.Stream | None = None
    _frames: LengthPrefixDecoder = field(default_factory=frames)
    _entry_stage: str = ""  # the entry as receipts name a stage
    _first_here: Prepared | None = None
    _unreachable: bool = False  # the last entry tried could not be reached at all

    def __post_init__(self) -> None:
        self.recovery = Recovery(self.deadline, changed=self.directory.changed)
        # The completion follows this agent's connection to its entry when it is replaced
        # (`api/gen_moves.py`), instead of replaying when the drain cuts its stream.
        self._rejoiner = Rejoiner(
            new_ticket(), lambda: self.directory.open_stream(self.entry, GENERATE_LABEL)
        )

    @property
    def replays(self) -> list:
        return self.recovery.replays

    @classmethod
    def continuing(
        cls, directory: ModelDirectory, ask: Ask, name: str, deadline: float, c: Continuation
    ) -> Carried:
        """A generation this agent began, to go on where the mesh moved its model."""
        return cls(
            directory,
            replace(ask, seed=c.seed),
            name,
            deadline,
            lambda: None,  # the model left this agent
            history=list(c.history),
            delivered=c.delivered,
            prompt_tokens=c.prompt_tokens,
        )

    async def start(self, remote: RemoteModel) -> Head:
        try:
            return await self._ask(remote)
        except Broken as e:
            await self._close()
            lost = (self._entry_stage,)
            first = await self._resume(f"the entry {remote.label} failed: {e}", lost)
        if isinstance(first, Prepared):  # this agent serves it by now
            self._first_here = first
            model, tokens = first.model, len(first.gen.prompt_tokens)
            receipt = self.directory.receipt(model)
            return Head(receipt, model.info.id, None, tokens, first.echo, first.tool_syntax)
        return first

    async def run(self, emit: Emit) -> None:
        if self._first_here is not None:
            await self._here(self._first_here, emit)
            return
        await self._follow(emit)

    async def hand_on(self, why: str, emit: Emit) -> None:
        """Continue, on the entry that serves the model now, a generation this agent served
        until the mesh moved the model (`continuing`)."""
        if not await self._moved_on(why, (), emit):
            await self._follow(emit)

    async def aclose(self) -> None:
        await self._close()

    async def _follow(self, emit: Emit) -> None:
        """The events of the entry asked last, emitted, moving on when it is lost, and onto
        the stream rejoined when its connection is replaced."""
        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._rejoiner.watch)
            try:
                await self._read_events(emit)
            except Exception as e:  # raised as itself below, not in the nursery's group
                failed = e
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _read_events(self, emit: Emit) -> None:
        while True:
            assert self._stream is not None
            try:
                msg = await read_message(self._stream, self._frames)
                if isinstance(msg, Moved):
                    await self._take_moved()
                    continue
            except Broken as e:
                await self._close()
                why = f"the entry {self._entry_label} was lost: {e}"
                if await self._moved_on(why, (self._entry_stage,), emit):
                    return
                continue
            if isinstance(msg, Fail):
                if not msg.resumable:
                    raise msg.error
                await self._close()
                why = f"the entry {self._entry_label} let go: {msg.error.message}"
                if await self._moved_on(why, (), emit):
                    return
                continue
            if not isinstance(msg, Delta | Finished):
                raise ApiError(502, "the entry sent an unexpected message", "server_error")
            self._served()
            if isinstance(msg, Finished):
                emit(replace(msg, replays=(*self.replays, *msg.replays)))
                await self._close()
                return
            self.history += msg.tokens
            self.delivered += len(msg.text)
            emit(msg)

    async def _moved_on(self, why: str, lost: tuple[str, ...], emit: Emit) -> bool:
        """Find the next entry (`_resume`); True when it was this agent and the request has
        run to its end here."""
        how = await self._resume(why, lost)
        if isinstance(how, Prepared):
            await self._here(how, emit)
            return True
        return False

    # -- finding an entry --

    async def _ask(self, remote: RemoteModel) -> Head:
        """Open `gen/1` to the peer, send the request (with the continuation so far) and read
        its head; `Broken` if that fails or the entry let go of the request, the entry's error
        as `ApiError` if it refused the request."""
        peer_id = remote.peer_id
        first_stage = remote.stages[0] if remote.stages else (peer_id, 0, remote.layers)
        self._entry_stage = "{}:{}-{}".format(*first_stage)
        try:
            stream = await self.directory.open_stream(peer_id, GENERATE_LABEL)
        except MeshError as e:
            self._unreachable = True
            raise Broken(f"unreachable: {e}") from e
        self._unreachable = False
        self._stream, self._frames, self.entry = stream, frames(), peer_id
        await self._rejoiner.reading(stream)
        self._entry_label = remote.label
        ask = replace(
            self.ask,
            history=tuple(self.history),
            delivered=self.delivered,
            ticket=self._rejoiner.ticket,
        )
        try:
            await stream.send_all(encode(ask))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise Broken(str(e)) from e
        first: Message | None = None
        with trio.move_on_after(HEAD_DEADLINE):
            first = await read_message(stream, self._frames)
        if first is None:
            raise Broken(f"no head within {HEAD_DEADLINE:g} s")
        if isinstance(first, Fail):
            await self._close()
            if first.resumable:
                raise Broken(first.error.message)
            raise first.error
        if not isinstance(first, Head):
            raise Broken("the entry answered without a head")
        self.ask = replace(self.ask, seed=first.seed)
        self.prompt_tokens = first.prompt_tokens
        return first

    async def _resume(self, why: str, lost: tuple[str, ...]) -> Head | Prepared:
        """The next entry for the request, asked with its continuation: a peer's `Head`, or
        the request prepared here when this agent serves the model now."""
        log.info("gen.entry_lost", reason=why, tokens=len(self.history))
        recovery = self.recovery
        recovery.broke(why)
        recovery.lost(lost)
        last = self.entry  # the entry that failed last: another replica is asked first
        try:
            while True:
                found = await recovery.until(lambda avoid=last: self.local() or self._remote(avoid))
                if isinstance(found, Prepared):
                    return found
                if found.peer_id == last:
                    await recovery.pause()  # the one that just failed: longer each time
                try:
                    with trio.move_on_after(recovery.left()):
                        return await self._ask(found)
                except Broken as e:
                    log.info("gen.entry_not_ready", peer=found.peer_id, error=str(e))
                    recovery.broke(str(e))
                    last = found.peer_id
                await self._close()
        except GaveUp:
            await self._close()
            if self._unreachable:
                raise errors.unavailable(
                    f"The peer serving '{self.name}' is unreachable ({why}).",
                    code="peer_unavailable",
                ) from None
            raise errors.unavailable(
                f"{why}; no agent took the request over within {self.deadline:g} s",
                code="split_unavailable",
                retry_after=errors.SPLIT_RETRY_AFTER,
            ) from None

    def _remote(self, avoid: str = "") -> RemoteModel | None:
        """A peer serving the model: another replica than `avoid` (the one that just failed)
        where there is one."""
        name = self.name.casefold()
        serving = [r for r in self.directory.remote_models() if r.id.casefold() == name]
        return next((r for r in serving if r.peer_id != avoid), serving[0] if serving else None)

    def _served(self) -> None:
        """An event came from the entry asked after a loss: that loss is over."""
        self.recovery.served(self.prompt_tokens + len(self.history))

    async def _here(self, prepared: Prepared, emit: Emit) -> None:
        """Go on with the model this agent serves now."""
        gen, seed = prepared.gen, self.ask.seed
        sampling = gen.sampling if seed is None else replace(gen.sampling, seed=seed)
        gen = replace(gen, sampling=sampling, history=tuple(self.history), delivered=self.delivered)
        try:
            check_history(
                gen, prepared.model.engine, check_fits(gen, prepared.model.engine.slot_ctx)
            )
        except OutOfRange as e:  # the entries' deltas: checked here, where the vocabulary is
            log.warning("gen.bad_continuation", peer=self.entry, reason=str(e))
            raise ApiError(
                502,
                f"An entry that served this request sent tokens it cannot have generated ({e}).",
                "server_error",
                code="bad_continuation",
            ) from e
        except ContextOverflow as e:
            raise api_error_for(e, prompt_param=prepared.prompt_param) from e
        self.prompt_tokens = len(gen.prompt_tokens)
        failed: list[MeshError] = []
        async with trio.open_nursery() as nursery:
            async for ev in generating(nursery, prepared.model, gen, failed):
                self._served()
                if isinstance(ev, Finished):
                    ev = replace(ev, replays=(*self.replays, *ev.replays))
                emit(ev)
        for e in failed:
            raise api_error_for(e, prompt_param=prepared.prompt_param) from e

    async def _take_moved(self) -> None:
        """The entry's `Moved`: read on from the stream rejoined (the old one is done)."""
        new = self._rejoiner.moved()
        if new is None:
            raise Broken("the entry moved the stream, and it was not asked to")
        old, (self._stream, self._frames) = self._stream, new
        if old is not None:
            with trio.CancelScope(shield=True):
                await old.aclose()

    async def _close(self) -> None:
        stream, self._stream = self._stream, None
        with trio.CancelScope(shield=True):
            await self._rejoiner.reading(None)
            if stream is not None:
                await stream.aclose()
