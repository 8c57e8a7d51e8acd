"""The request path of a completion, whatever protocol its client speaks (`openai_routes.py`,
`responses.py`, `ollama.py`): read, metered, parsed, routed to this agent's model (`here.py`)
or to the peer that serves it (`elsewhere.py`), and its events handed to the protocol's
`Deliver`, which writes the reply. A request runs within the shutdown's grace (`InFlight`) and
stops when its client leaves."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

import structlog
import trio

from meshagent.api import elsewhere, errors, here
from meshagent.api.catalog import Catalog
from meshagent.api.completion_events import Completion, Deliver, Event, Events, Failed
from meshagent.api.errors import ApiError, api_error_for
from meshagent.api.exchange import Exchange
from meshagent.api.here import Continuation
from meshagent.api.metrics import FORWARDED, LOCAL, SPLIT, Metrics, RequestMeter
from meshagent.api.prepare import Asked, Prepared, parse_completion, prepare
from meshagent.api.routing import LOCAL as HERE
from meshagent.api.routing import PrefixRouter, prefix_keys
from meshagent.errors import ContextOverflow
from meshagent.placement.demand import DemandError, keep_alive_seconds
from meshagent.serving.directory import RemoteModel
from meshagent.serving.generation import check_fits

log = structlog.get_logger(__name__)

_STOPPED = errors.unavailable(
    "The agent shut down before this completion finished (the shutdown grace expired).",
    code="shutting_down",
)

# Seconds a stream waits for its model to load before it opens with keep-alive comments, and
# between them.
LOAD_KEEP_ALIVE = 5.0

# The request's JSON and the bytes it came in (read within the request's meter).
Body = Callable[[], Awaitable[tuple[object, bytes]]]
Produce = Callable[[Events], Awaitable[None]]


def _keep_alive(data: object) -> float | None:
    """The request's `keep_alive` (ollama's field: seconds, or a duration like "5m"; 0:
    unload after it; negative: never), if it gives one; 400 if it is not a duration."""
    value = data.get("keep_alive") if isinstance(data, dict) else None
    try:
        return keep_alive_seconds(value)
    except DemandError as e:
        raise errors.bad_request(str(e), param="keep_alive") from e


class Completions:
    def __init__(self, catalog: Catalog, metrics: Metrics, router: PrefixRouter) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.router = router

    async def complete(
        self, ex: Exchange, path: str, body: Body, deliver: Deliver, *, sse: bool = False
    ) -> None:
        """Answer the completion request `body` to the endpoint `path` (`prepare.KINDS`) with
        `deliver`; an `ApiError` when it fails before any agent took it. `sse`: the protocol
        streams server-sent events, so a stream that waits for its model to load opens early
        and is kept alive with comments (`LOAD_KEEP_ALIVE`)."""
        meter = self.metrics.request()
        demanded: str | None = None  # the catalogued model this request is demand for
        keep_alive: float | None = None
        try:
            data, raw = await body()
            name = data.get("model") if isinstance(data, dict) else None
            if isinstance(name, str) and self.catalog.known(name):
                meter.model = name  # only models the mesh has: a label's values stay few
            asked = Asked(path, raw, parse_completion(path, data))
            loads = self.catalog.loads
            if loads is not None and isinstance(name, str):
                demanded = self.catalog.catalogued(name)
                if demanded is not None:
                    keep_alive = _keep_alive(data)
                    loads.begin(demanded)
            await self._route(ex, asked, meter, deliver, sse=sse)
        except ApiError as e:
            meter.fail(e.status, e.message)
            raise
        finally:
            meter.done(ex.status, client_gone=ex.disconnected)
            if demanded is not None and self.catalog.loads is not None:
                self.catalog.loads.end(demanded, meter.work, keep_alive)

    async def _route(
        self, ex: Exchange, asked: Asked, meter: RequestMeter, deliver: Deliver, *, sse: bool
    ) -> None:
        name = asked.req.model
        if sse and asked.req.stream and self.catalog.must_load(name):
            await self._await_loaded_kept_alive(ex, name)
        else:
            await self.catalog.await_served(name)
        remotes = {r.peer_id: r for r in self.catalog.remotes(name)}
        local = [HERE] if self.catalog.local(name) is not None else []
        if not remotes:
            await self._here(ex, asked, meter, deliver)
            return
        if not local and len(remotes) == 1:  # one peer serves it: nothing to choose
            await self._elsewhere(ex, asked, next(iter(remotes.values())), meter, deliver)
            return
        # Several replicas: the one holding the conversation takes it (`api/routing.py`).
        keys = prefix_keys(asked.req)
        route = self.router.choose(keys, [*local, *remotes])
        with self.router.routed(route.peer, keys):
            if route.peer == HERE:
                await self._here(ex, asked, meter, deliver)
            else:
                await self._elsewhere(ex, asked, remotes[route.peer], meter, deliver)

    async def _await_loaded_kept_alive(self, ex: Exchange, name: str) -> None:
        """Wait for `name` to load as `await_served` does; past `LOAD_KEEP_ALIVE` s the stream
        opens (without the receipt headers: who serves it is not known yet) and an SSE
        comment says so every as many seconds, so that no client or proxy gives up on a
        silent connection. An error then comes as an event (`OpenAIApp`)."""
        async with trio.open_nursery() as nursery:

            async def comments() -> None:
                await trio.sleep(LOAD_KEEP_ALIVE)
                if not ex.started:
                    await ex.start_sse()
                while True:
                    await ex.send_comment(f"loading {name}")
                    await trio.sleep(LOAD_KEEP_ALIVE)

            nursery.start_soon(comments)
            error: ApiError | None = None
            try:
                await self.catalog.await_served(name)
            except ApiError as e:  # raised from here, not in an exception group
                error = e
            finally:
                nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _here(
        self, ex: Exchange, asked: Asked, meter: RequestMeter, deliver: Deliver
    ) -> None:
        p = prepare(asked.req, self.catalog.model(asked.req.model))
        self._refuse_when_draining()
        try:
            check_fits(p.gen, p.model.engine.slot_ctx)
        except ContextOverflow as e:
            raise api_error_for(e, prompt_param=p.prompt_param) from e
        gen = replace(p.gen, sampling=p.gen.sampling.seeded())  # kept if the request moves
        receipt = self.catalog.directory.receipt(p.model)
        split = any(name == b"x-meshagent-wire-dtype" for name, _ in receipt)
        meter.path = SPLIT if split else LOCAL

        async def moved(sent: Continuation, out: Events) -> None:
            await elsewhere.serve(self.catalog.directory, asked, out, moved=sent)

        produce = partial(here.serve, p, gen, here.opened(p, receipt), moved=moved)
        await self._run(ex, produce, deliver, meter)

    async def _elsewhere(
        self, ex: Exchange, asked: Asked, remote: RemoteModel, meter: RequestMeter, deliver: Deliver
    ) -> None:
        self._refuse_when_draining()
        meter.path = FORWARDED

        def prepared_here() -> Prepared | None:  # the mesh moved the model here mid-request
            model = self.catalog.local(asked.req.model)
            return None if model is None else prepare(asked.req, model)

        directory = self.catalog.directory
        produce = partial(elsewhere.serve, directory, asked, remote=remote, here=prepared_here)
        await self._run(ex, produce, deliver, meter)

    async def _run(
        self, ex: Exchange, produce: Produce, deliver: Deliver, meter: RequestMeter
    ) -> None:
        """`produce`'s events to `deliver`, stopped when the client leaves; when the
        shutdown's grace expires first, the client is told so in its protocol's words."""
        send, events = trio.open_memory_channel[Event](math.inf)
        with self.catalog.inflight.track() as grace:

            async def producing() -> None:
                async with send:
                    with grace:
                        await produce(send)
                    if grace.cancelled_caught:
                        send.send_nowait(Failed(_STOPPED))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                nursery.start_soon(producing)
                await deliver(ex, Completion(events, meter))
                nursery.cancel_scope.cancel()
        if ex.disconnected and not ex.finished:
            log.info("request.client_gone", model=meter.model, path=meter.path)

    def _refuse_when_draining(self) -> None:
        if self.catalog.inflight.draining:
            raise errors.unavailable(
                "The agent is shutting down and takes no new requests.", code="shutting_down"
            )
