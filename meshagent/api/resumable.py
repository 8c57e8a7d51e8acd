"""A completion carried to the peer that serves its model so that it survives losing that peer.

The agent holding the client's connection (the asker) opens a `gen/1` stream to the entry that
serves the model (`GENERATE_LABEL`) and sends the request (`Ask`: method, path, body). The entry
prepares it as its own API would and answers with a `Head` (its receipt, the canonical model
name, the seed it samples with, the prompt's length) or a `Fail`, then streams generation
events: each `delta` carries its text and the token ids behind it; `done` ends it with the
usage, or `fail` with an OpenAI-shaped error. The asker formats the client's response itself,
so it knows exactly which tokens and characters the client has.

When the entry is lost (its stream breaks, or it answers `fail` marked resumable: it is
shutting down, or the mesh moved the model), the asker asks the entry that serves the model
next (or serves it itself, if the mesh moved the model here) with the same request plus a
continuation: the tokens so far, the characters delivered and the seed. The new entry prefills
prompt and tokens and goes on from the next token (`generation.generate`), and the client
sees one stream: the same text an undisturbed run gives, greedy or seeded. Past the deadline
with no entry, the request fails as temporarily unavailable.

The messages are in `api/gen_messages.py`, which checks each field's range as it decodes;
the entry checks a continuation against its model (the vocabulary, the request's limit, the
text's length) before it answers. Neither side waits for a stream's first message for ever:
the entry gives up on an ask after `ASK_DEADLINE`, the asker on a head after `HEAD_DEADLINE`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
import trio

from meshagent.api import errors
from meshagent.api.errors import ApiError, api_error_for
from meshagent.api.forwarding import FRAMING
from meshagent.api.gen_messages import Ask, Fail, GenMessageError, Head, Message, decode, encode
from meshagent.api.prepare import Prepared
from meshagent.errors import ContextOverflow, MeshError, ModelMoved, OutOfRange, ShuttingDown
from meshagent.net.errors import StreamResetError
from meshagent.net.frame_reader import receive_frame
from meshagent.serving.directory import GENERATE_LABEL, ModelDirectory, RemoteModel
from meshagent.serving.generation import Delta, Finished, Replay, check_fits, check_history
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)

_RETRY_FIRST, _RETRY_MAX = 0.25, 2.0  # seconds before asking again after an entry failed
_LOOK = 0.05  # seconds between looks at the directory for an entry that serves
_LINGER = 5.0  # seconds an entry waits for the asker to close after the last message
# Seconds an entry waits for the ask once a gen/1 stream is open (the asker sends it at once),
# and an asker for the entry's head or fail once it sent the ask (the entry answers once it has
# prepared the request, before it generates).
ASK_DEADLINE = 30.0
HEAD_DEADLINE = 30.0

Events = trio.MemorySendChannel[Delta | Finished]


class Broken(MeshError):
    """The stream to the entry broke or carried something that is not a message."""


async def _read(stream: Any, frames: LengthPrefixDecoder) -> Message:
    try:
        body = await receive_frame(
            stream, frames, on_eof=lambda: Broken("the peer ended the stream mid-generation")
        )
    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
        raise Broken(str(e)) from e
    except MeshError as e:  # the framing's limit
        raise Broken(str(e)) from e
    try:
        return decode(body)
    except GenMessageError as e:
        raise Broken(str(e)) from e


# ----- the entry: serving a carried request -----


async def serve(stream: Any, app: Any, *, peer_id: str) -> None:
    """Answer one `gen/1` stream with the local model (`app` is the agent's `OpenAIApp`)."""
    ask = await _receive_ask(stream, peer_id)
    if ask is None:
        return
    try:
        with app.inflight.track() as grace:
            with grace:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_asker, stream, nursery.cancel_scope)
                    await _answer(stream, app, ask, peer_id)
                    nursery.cancel_scope.cancel()
            if grace.cancelled_caught:  # the shutdown grace expired: another entry goes on
                gone = errors.unavailable("the entry shut down", code="shutting_down")
                await _send_quietly(stream, Fail(gone, True))
        with trio.move_on_after(_LINGER):  # the asker closes first (see api/forwarding.py)
            await _watch_asker(stream, None)
    except* (trio.BrokenResourceError, trio.ClosedResourceError):  # alone or from a nursery
        log.info("gen.asker_gone", peer=peer_id, path=ask.path)


async def _receive_ask(stream: Any, peer_id: str) -> Ask | None:
    """The stream's ask; None when there is none to answer (no ask within `ASK_DEADLINE`, or
    a first message that is not one): the asker is told why in a `Fail`."""
    why = f"no ask within {ASK_DEADLINE:g} s"
    with trio.move_on_after(ASK_DEADLINE):
        try:
            first = await _read(stream, LengthPrefixDecoder(FRAMING))
            if isinstance(first, Ask):
                return first
            why = "a gen/1 stream must begin with an ask"
        except Broken as e:
            why = str(e)
    await _refuse(stream, peer_id, why, code="invalid_gen_message")
    with trio.move_on_after(_LINGER):  # the asker reads the Fail, then closes
        await _watch_asker(stream, None)
    return None


async def _refuse(stream: Any, peer_id: str, why: str, *, code: str) -> None:
    """Refuse an ask a peer should not have sent: logged, and a `Fail` on its stream."""
    log.warning("gen.ask_refused", peer=peer_id, reason=why)
    await _send_quietly(stream, Fail(errors.bad_request(f"Ask refused: {why}.", code=code), False))


async def _answer(stream: Any, app: Any, ask: Ask, peer_id: str) -> None:
    try:
        prepared: Prepared | None = app.prepare_here(ask.path, ask.body)
        if prepared is None:  # the mesh moved the model, or this agent is stopping
            why = "this agent does not serve the model now"
            await stream.send_all(encode(Fail(errors.unavailable(why), True)))
            return
        sampling = prepared.gen.sampling
        sampling = replace(sampling, seed=ask.seed) if ask.seed is not None else sampling.seeded()
        gen = replace(prepared.gen, sampling=sampling, history=ask.history, delivered=ask.delivered)
        limit = check_fits(gen, prepared.model.engine.slot_ctx)
        check_history(gen, prepared.model.engine, limit)
    except OutOfRange as e:  # a continuation this model cannot have generated
        await _refuse(stream, peer_id, str(e), code="invalid_continuation")
        return
    except ApiError as e:
        await stream.send_all(encode(Fail(e, False)))
        return
    except MeshError as e:  # the prompt does not fit
        await stream.send_all(encode(Fail(api_error_for(e, prompt_param="prompt"), False)))
        return
    model = prepared.model
    receipt = app.directory.receipt(model)
    head = Head(
        receipt,
        model.info.id,
        sampling.seed,
        len(gen.prompt_tokens),
        prepared.echo,
        prepared.tool_syntax,
    )
    await stream.send_all(encode(head))
    failed: list[MeshError] = []
    async with trio.open_nursery() as nursery:
        events = _generating(nursery, model, gen, failed)
        async for ev in events:
            await stream.send_all(encode(ev))
    for e in failed:
        resumable = isinstance(e, (ShuttingDown, ModelMoved))
        err = api_error_for(e, prompt_param=prepared.prompt_param)
        await _send_quietly(stream, Fail(err, resumable))


async def generate_counted(
    model: Any, gen: Any, out: Events
) -> tuple[list[int], int, MeshError | None]:
    """`model` generating `gen` into `out`: the tokens and the characters sent, and the error
    it ended with, if any (what a request needs to be handed on: `Carried.hand_on`)."""
    failed: list[MeshError] = []
    tokens: list[int] = []
    chars = 0
    async with trio.open_nursery() as nursery:
        async for ev in _generating(nursery, model, gen, failed):
            if isinstance(ev, Delta):
                tokens += ev.tokens
                chars += len(ev.text)
            out.send_nowait(ev)
    return tokens, chars, failed[0] if failed else None


def _generating(
    nursery: trio.Nursery, model: Any, gen: Any, failed: list[MeshError]
) -> trio.MemoryReceiveChannel[Delta | Finished]:
    """`model` generating `gen` in `nursery`: its events, and its error put in `failed`."""
    send, events = trio.open_memory_channel[Delta | Finished](math.inf)

    async def produce() -> None:
        async with send:
            try:
                await model.generate(gen, send)
            except MeshError as e:
                failed.append(e)

    nursery.start_soon(produce)
    return events


async def _watch_asker(stream: Any, scope: trio.CancelScope | None) -> None:
    """Return (cancelling `scope`) when the asker closes its side: its client went away."""
    try:
        while await stream.receive_some():
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if scope is not None:
        scope.cancel()


async def _send_quietly(stream: Any, msg: Message) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(encode(msg))


# ----- the asker: one client's request, across entries -----


def _knows_no_gen(e: BaseException) -> bool:
    """An agent from before `gen/1` resets the stream as a label it does not serve."""
    return isinstance(e.__cause__, StreamResetError) and "no service" in e.__cause__.reason


@dataclass
class Carried:
    """One request carried to entries of the mesh, from the agent that holds its client.

    `start` finds the first entry and returns its `Head` (None when that entry predates
    `gen/1`: carry the request over `api/1` instead); `run` then sends the events to `out`
    until `Finished`, continuing on another entry when one is lost, and raises `ApiError` when
    the request fails."""

    directory: ModelDirectory
    ask: Ask
    name: str  # the model requested
    deadline: float  # seconds to find a new entry after a loss
    # A continuation prepared on this agent, if it serves the model itself now.
    local: Callable[[], Prepared | None]
    entry: str = ""  # the peer serving the request now
    history: list[int] = field(default_factory=list)
    delivered: int = 0
    prompt_tokens: int = 0
    replays: list[Replay] = field(default_factory=list)
    _stream: Any = None
    _frames: LengthPrefixDecoder = field(default_factory=lambda: LengthPrefixDecoder(FRAMING))
    # Why, when, when the next entry was asked, and what was lost: the request's break.
    _broke: tuple[str, float, float, tuple[str, ...]] | None = None
    _entry_stage: str = ""  # the entry as receipts name a stage
    _first_here: Prepared | None = None
    _unreachable: bool = False  # the last entry tried could not be reached at all

    async def start(self, remote: RemoteModel) -> Head | None:
        try:
            return await self._ask(remote)
        except Broken as e:
            await self._close()
            if _knows_no_gen(e):
                return None
            lost = (self._entry_stage,)
            first = await self._resume(f"the entry {remote.peer_id[:12]} failed: {e}", lost)
        if isinstance(first, Prepared):  # this agent serves it by now
            self._first_here = first
            model, tokens = first.model, len(first.gen.prompt_tokens)
            receipt = self.directory.receipt(model)
            return Head(receipt, model.info.id, None, tokens, first.echo, first.tool_syntax)
        return first

    async def run(self, out: Events) -> None:
        if self._first_here is not None:
            await self._here(self._first_here, out)
            return
        await self._follow(out)

    async def hand_on(self, why: str, out: Events) -> None:
        """Continue, on the entry that serves the model now, a request this agent served
        until the mesh moved the model (`history`, `delivered` and the ask's seed set)."""
        if not await self._moved_on(why, (), out):
            await self._follow(out)

    async def _follow(self, out: Events) -> None:
        """The events of the entry asked last, to `out`, moving on when it is lost."""
        while True:
            try:
                msg = await _read(self._stream, self._frames)
            except Broken as e:
                await self._close()
                why = f"the entry {self.entry[:12]} was lost: {e}"
                if await self._moved_on(why, (self._entry_stage,), out):
                    return
                continue
            if isinstance(msg, Fail):
                if not msg.resumable:
                    raise msg.error
                await self._close()
                why = f"the entry {self.entry[:12]} let go: {msg.error.message}"
                if await self._moved_on(why, (), out):
                    return
                continue
            if not isinstance(msg, Delta | Finished):
                raise ApiError(502, "the entry sent an unexpected message", "server_error")
            self._served()
            if isinstance(msg, Finished):
                out.send_nowait(replace(msg, replays=(*self.replays, *msg.replays)))
                await self._close()
                return
            self.history += msg.tokens
            self.delivered += len(msg.text)
            out.send_nowait(msg)

    async def _moved_on(self, why: str, lost: tuple[str, ...], out: Events) -> bool:
        """Find the next entry (`_resume`); True when it was this agent and the request has
        run to its end here."""
        how = await self._resume(why, lost)
        if isinstance(how, Prepared):
            await self._here(how, out)
            return True
        return False

    async def aclose(self) -> None:
        await self._close()

    # -- finding an entry --

    async def _ask(self, remote: RemoteModel) -> Head:
        """Open `gen/1` to `peer_id`, send the request (with the continuation so far) and read
        its head; `Broken` if that fails or the entry let go of the request, the entry's error as
        `ApiError` if it refused the request."""
        peer_id = remote.peer_id
        first_stage = remote.stages[0] if remote.stages else (peer_id, 0, remote.layers)
        self._entry_stage = "{}:{}-{}".format(*first_stage)
        try:
            stream = await self.directory.open_stream(peer_id, GENERATE_LABEL)
        except MeshError as e:
            self._unreachable = True
            raise Broken(f"unreachable: {e}") from e
        self._unreachable = False
        self._stream, self._frames, self.entry = stream, LengthPrefixDecoder(FRAMING), peer_id
        ask = replace(self.ask, history=tuple(self.history), delivered=self.delivered)
        try:
            await stream.send_all(encode(ask))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise Broken(str(e)) from e
        first: Message | None = None
        with trio.move_on_after(HEAD_DEADLINE):
            first = await _read(stream, self._frames)
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
        since = trio.current_time()
        log.info("gen.entry_lost", reason=why, tokens=len(self.history))
        failed = 0  # asks that an entry did not take
        # The entry that failed last (another replica is asked first), and when to ask it again.
        last, next_ask = self.entry, since
        while (waited := trio.current_time() - since) < self.deadline:
            prepared = self.local()
            if prepared is not None:
                self._broke = (why, since, trio.current_time(), lost)
                return prepared
            remote = self._remote(avoid=last)
            if remote is None or (remote.peer_id == last and trio.current_time() < next_ask):
                await trio.sleep(_LOOK)  # no entry serves yet, or it is the one that just failed
                continue
            asked = trio.current_time()
            try:
                with trio.move_on_after(self.deadline - waited):
                    head = await self._ask(remote)
                    self._broke = (why, since, asked, lost)
                    return head
            except Broken as e:
                failed += 1
                log.info("gen.entry_not_ready", peer=remote.peer_id, error=str(e), tries=failed)
                last = remote.peer_id
                next_ask = trio.current_time() + min(_RETRY_FIRST * 2 ** (failed - 1), _RETRY_MAX)
            await self._close()
        if self._unreachable:
            raise errors.unavailable(
                f"The peer serving '{self.name}' is unreachable ({why}).", code="peer_unavailable"
            )
        raise errors.unavailable(
            f"{why}; no agent took the request over within {self.deadline:g} s",
            code="split_unavailable",
            retry_after=errors.SPLIT_RETRY_AFTER,
        )

    def _remote(self, avoid: str = "") -> RemoteModel | None:
        """A peer serving the model: another replica than `avoid` (the one that just failed)
        where there is one."""
        name = self.name.casefold()
        serving = [r for r in self.directory.remote_models() if r.id.casefold() == name]
        return next((r for r in serving if r.peer_id != avoid), serving[0] if serving else None)

    def _served(self) -> None:
        """An event came from the entry asked after a loss: that loss is over."""
        if self._broke is None:
            return
        why, since, asked, lost = self._broke
        now = trio.current_time()
        tokens = self.prompt_tokens + len(self.history)
        ms, wait_ms = round((now - since) * 1000, 1), round((asked - since) * 1000, 1)
        self.replays.append(Replay(why, tokens, ms, wait_ms, lost))
        self._broke = None

    async def _here(self, prepared: Prepared, out: Events) -> None:
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
            async for ev in _generating(nursery, prepared.model, gen, failed):
                self._served()
                if isinstance(ev, Finished):
                    ev = replace(ev, replays=(*self.replays, *ev.replays))
                out.send_nowait(ev)
        for e in failed:
            raise api_error_for(e, prompt_param=prepared.prompt_param) from e

    async def _close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            with trio.CancelScope(shield=True):
                await stream.aclose()
