"""The entry's side of `gen/1` (docs/protocol.md 11.1): a request another agent carried here,
answered by the model this agent serves.

The entry prepares a completion as its own API would (`api/prepare.py`) and answers with a
`Head` or a `Fail`, then streams the generation's events; embeddings it answers with a `Vector`
per input and an `Embedded`. It checks a continuation against its model (the vocabulary, the
request's limit, the text's length) before it answers, and gives up on a stream whose ask does
not come within `ASK_DEADLINE`. An entry that lets go of a request (it is shutting down, or the
mesh moved the model) says so in a resumable `Fail`: the asker goes on elsewhere. A member may
ask only for inference this way: any other path is refused (404)."""

from __future__ import annotations

import json
from dataclasses import replace

import structlog
import trio

from meshagent.api import errors
from meshagent.api.catalog import Catalog
from meshagent.api.embeddings import EMBEDDINGS_PATH, embed_here, parse_embedding
from meshagent.api.errors import ApiError, api_error_for
from meshagent.api.gen_messages import Ask, Embedded, Fail, Head, Rejoin, Vector
from meshagent.api.gen_moves import Answering
from meshagent.api.gen_stream import Broken, frames, read_message, send_quietly
from meshagent.api.here import generating
from meshagent.api.prepare import KINDS, Prepared, parse_completion, prepare
from meshagent.errors import MeshError, ModelMoved, OutOfRange, ShuttingDown
from meshagent.serving.generation import check_fits, check_history

log = structlog.get_logger(__name__)

_LINGER = 5.0  # seconds an entry waits for the asker to close after the last message
ASK_DEADLINE = 30.0  # seconds for the ask once a gen/1 stream is open (the asker sends it at once)


async def serve(stream: trio.abc.Stream, catalog: Catalog, *, peer_id: str) -> None:
    """Answer one `gen/1` stream from `peer_id` with the model this agent serves: an ask, or
    a rejoin of a completion the peer asked on another stream (`api/gen_moves.py`)."""
    ask = await _receive_ask(stream, peer_id)
    if isinstance(ask, Rejoin):
        await _rejoin(stream, catalog, peer_id, ask.ticket)
        return
    if ask is None:
        return
    answering = Answering(stream)
    await catalog.rejoins.answer(lambda: _answer(answering, catalog, ask, peer_id), answering)


async def _answer(answering: Answering, catalog: Catalog, ask: Ask, peer_id: str) -> None:
    """Answer `ask` on the stream in force, whichever connection it is on by then."""
    try:
        with (
            catalog.inflight.track() as grace,
            catalog.rejoins.holding(peer_id, ask.ticket, answering),
        ):
            with grace:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_asker, answering, nursery.cancel_scope)
                    if ask.path == EMBEDDINGS_PATH:
                        await _embed(answering, catalog, ask)
                    else:
                        await _generate(answering, catalog, ask, peer_id)
                    nursery.cancel_scope.cancel()
            if grace.cancelled_caught:  # the shutdown grace expired: another entry goes on
                gone = errors.unavailable("the entry shut down", code="shutting_down")
                await answering.send_quietly(Fail(gone, True))
        # Let the asker read everything and close its side first: closing a stream whose peer
        # still sends resets it, and a reset drops what is still in flight.
        with trio.move_on_after(_LINGER):
            await answering.asker_gone()
    except* (trio.BrokenResourceError, trio.ClosedResourceError):  # alone or from a nursery
        log.info("gen.asker_gone", peer=peer_id, path=ask.path)
    finally:
        answering.done.set()


async def _rejoin(stream: trio.abc.Stream, catalog: Catalog, peer_id: str, ticket: int) -> None:
    """The rest of the completion `peer_id` asked with `ticket` goes on `stream`, which
    stays open until that completion is answered; a `Fail` where none is answered here."""
    answering = catalog.rejoins.find(peer_id, ticket)
    if answering is None:
        why = "no completion of this asker with that ticket is answered here"
        await send_quietly(stream, Fail(errors.not_found(why, code="unknown_ticket"), False))
        with trio.move_on_after(_LINGER):
            await Answering(stream).asker_gone()
        return
    await answering.move_to(stream)
    await answering.done.wait()


def prepare_carried(catalog: Catalog, path: str, body: bytes) -> Prepared | None:
    """A completion carried here, prepared on the model this agent serves; None if it serves
    that model no more (or is stopping), and an `ApiError` if the request is bad."""
    if path not in KINDS:
        raise errors.not_found(f"Unknown endpoint POST {path}.", code="unknown_url")
    req = parse_completion(path, _json(body))
    model = catalog.local(req.model)
    if model is None or catalog.inflight.draining:
        return None
    return prepare(req, model)


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError as e:  # not JSON, not UTF-8, or an integer past 4300 digits
        raise errors.bad_request(f"We could not parse the JSON body ({e}).") from e


async def _receive_ask(stream: trio.abc.Stream, peer_id: str) -> Ask | Rejoin | None:
    """The stream's ask (or rejoin); None when there is none to answer (no ask within
    `ASK_DEADLINE`, or a first message that is neither): the asker is told why in a `Fail`."""
    why = f"no ask within {ASK_DEADLINE:g} s"
    with trio.move_on_after(ASK_DEADLINE):
        try:
            first = await read_message(stream, frames())
            if isinstance(first, Ask | Rejoin):
                return first
            why = "a gen/1 stream must begin with an ask or a rejoin"
        except Broken as e:
            why = str(e)
    await _refuse(stream, peer_id, why, code="invalid_gen_message")
    with trio.move_on_after(_LINGER):  # the asker reads the Fail, then closes
        await Answering(stream).asker_gone()
    return None


async def _refuse(stream: trio.abc.Stream, peer_id: str, why: str, *, code: str) -> None:
    """Refuse an ask a peer should not have sent: logged, and a `Fail` on its stream."""
    log.warning("gen.ask_refused", peer=peer_id, reason=why)
    await send_quietly(stream, Fail(errors.bad_request(f"Ask refused: {why}.", code=code), False))


async def _generate(out: Answering, catalog: Catalog, ask: Ask, peer_id: str) -> None:
    try:
        prepared = prepare_carried(catalog, ask.path, ask.body)
        if prepared is None:  # the mesh moved the model, or this agent is stopping
            why = "this agent does not serve the model now"
            await out.send(Fail(errors.unavailable(why), True))
            return
        sampling = prepared.gen.sampling
        sampling = replace(sampling, seed=ask.seed) if ask.seed is not None else sampling.seeded()
        # The n completions of one request share a prefill: keyed by their asker's key.
        share = None if ask.share is None else f"{peer_id}:{ask.share}"
        gen = replace(
            prepared.gen,
            sampling=sampling,
            history=ask.history,
            delivered=ask.delivered,
            share=share,
        )
        limit = check_fits(gen, prepared.model.engine.slot_ctx)
        check_history(gen, prepared.model.engine, limit)
    except OutOfRange as e:  # a continuation this model cannot have generated
        await _refuse(out.stream, peer_id, str(e), code="invalid_continuation")
        return
    except ApiError as e:
        await out.send(Fail(e, False))
        return
    except MeshError as e:  # the prompt does not fit
        await out.send(Fail(api_error_for(e, prompt_param="prompt"), False))
        return
    model = prepared.model
    receipt = catalog.directory.receipt(model)
    prompt = len(gen.prompt_tokens)
    echo, tools = prepared.echo, prepared.tool_syntax
    await out.send(Head(receipt, model.info.id, sampling.seed, prompt, echo, tools))
    failed: list[MeshError] = []
    async with trio.open_nursery() as nursery:
        async for ev in generating(nursery, model, gen, failed):
            await out.send(ev)
    for e in failed:
        resumable = isinstance(e, (ShuttingDown, ModelMoved))
        err = api_error_for(e, prompt_param=prepared.prompt_param)
        await out.send_quietly(Fail(err, resumable))


async def _embed(out: Answering, catalog: Catalog, ask: Ask) -> None:
    try:
        req = parse_embedding(_json(ask.body))
        texts = req.texts()
        model = catalog.local(req.model)
        if model is None or catalog.inflight.draining:
            why = "this agent does not serve the model now"
            await out.send(Fail(errors.unavailable(why), True))
            return
        vectors, tokens = await embed_here(model, texts)
    except ApiError as e:
        await out.send(Fail(e, False))
        return
    for vector in vectors:
        await out.send(Vector(tuple(vector)))
    await out.send(Embedded(model.info.id, tokens))


async def _watch_asker(out: Answering, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the asker closes its side: its client went away."""
    await out.asker_gone()
    scope.cancel()
