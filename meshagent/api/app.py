"""The ASGI application: OpenAI-compatible endpoints, health and control."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from functools import partial
from importlib import resources
from typing import Any

import structlog
import trio

from meshagent.api import errors, forwarding, ollama
from meshagent.api.access import Access, refuse_peer
from meshagent.api.choices import produce_choices
from meshagent.api.delivery import Event, Failed, stream_reply, whole_reply
from meshagent.api.embeddings import embedding_reply, parse_embedding
from meshagent.api.errors import SPLIT_RETRY_AFTER, ApiError, api_error_for
from meshagent.api.events import EventHub, serve_events
from meshagent.api.exchange import ClientGone, Exchange
from meshagent.api.inflight import InFlight
from meshagent.api.metrics import CONTENT_TYPE, FORWARDED, LOCAL, SPLIT, Metrics, RequestMeter
from meshagent.api.prepare import KINDS, CompletionKind, Prepared, parse_completion, prepare
from meshagent.api.replies import Reply
from meshagent.api.responses import Remembered, serve_responses
from meshagent.api.resumable import Ask, Carried, Head, generate_counted
from meshagent.api.routing import LOCAL as HERE
from meshagent.api.routing import PrefixRouter, prefix_keys
from meshagent.api.schemas import ChatCompletionRequest
from meshagent.api.tools import SYNTAXES
from meshagent.discovery.probe import ProbeTimeout
from meshagent.errors import ContextOverflow, MeshError, ModelMoved
from meshagent.serving.directory import ModelDirectory, RemoteModel
from meshagent.serving.generation import Delta, Finished, GenerationRequest, check_fits
from meshagent.serving.local_model import LocalModel
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)


_SERVED_POLL = 0.1  # seconds between looks for a model being placed again
# Seconds an embeddings request carried to the peer serving its model may take, answer and
# all (this agent's own take at most 256 inputs of 2048 tokens).
EMBEDDINGS_DEADLINE = 300.0


class OpenAIApp:
    def __init__(
        self,
        directory: ModelDirectory,
        inflight: InFlight,
        status: Callable[[], dict[str, Any]],
        *,
        peers: Callable[[], dict[str, Any]] | None = None,
        probe: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] | None = None,
        access: Access | None = None,
    ) -> None:
        """`directory` says which models this agent serves and where the others run; `access`
        who may ask over HTTP."""
        self.directory = directory
        self.access = access or Access()
        self.inflight = inflight
        self.status = status
        self.peers = peers
        self.probe = probe
        self.started_at = int(time.time())
        self.router = PrefixRouter()
        self.remembered = Remembered()  # conversations of recent responses (`/v1/responses`)
        self.events = EventHub()
        self.metrics = Metrics(status, on_request=self.events.request_ended)
        self._routes: dict[tuple[str, str], Callable[[Exchange], Any]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._list_models,
            ("POST", "/v1/chat/completions"): self._generate,
            ("POST", "/v1/completions"): self._generate,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/v1/responses"): self._responses,
            ("GET", "/api/tags"): self._ollama_tags,
            ("POST", "/api/chat"): self._ollama_chat,
            ("POST", "/api/generate"): self._ollama_generate,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/console"): self._console,
            ("GET", "/control/events"): self._control_events,
            ("GET", "/control/status"): self._control_status,
            ("GET", "/control/peers"): self._control_peers,
            ("POST", "/control/probe"): self._control_probe,
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        ex = Exchange(scope, receive, send)
        try:
            peer = scope.get("meshagent.forwarded_by")
            if peer is not None:  # over the overlay: a member of the mesh, inference only
                refused = refuse_peer(ex.method, ex.path)
                if refused is not None:
                    log.warning(
                        "api.peer_refused", peer=peer, method=ex.method[:16], path=ex.path[:200]
                    )
            else:
                refused = self.access.refuse(ex.method, ex.path, scope.get("headers", ()))
            if refused is not None:
                raise refused
            await self._dispatch(ex)
        except ApiError as e:
            if not ex.started:
                await ex.send_error(e)
        except ClientGone:
            pass

    async def _dispatch(self, ex: Exchange) -> None:
        handler = self._routes.get((ex.method, ex.path))
        if handler is not None:
            await handler(ex)
            return
        if ex.method == "GET" and ex.path.startswith("/v1/models/"):
            name = ex.path.removeprefix("/v1/models/")
            remote = self._remote(name)
            if remote is not None and self._local(name) is None:
                await ex.send_json(200, self._remote_card(remote))
                return
            model = self._model(name, param=None)
            await ex.send_json(200, self._model_card(model))
            return
        if any(path == ex.path for _, path in self._routes):
            raise ApiError(405, f"Method {ex.method} is not allowed on {ex.path}.")
        raise errors.not_found(f"Unknown endpoint {ex.method} {ex.path}.", code="unknown_url")

    # -- simple endpoints ------------------------------------------------------------------

    async def _health(self, ex: Exchange) -> None:
        if self.inflight.draining:
            await ex.send_json(503, {"status": "draining"})
        else:
            await ex.send_json(200, {"status": "ok"})

    def _model_card(self, model: LocalModel) -> dict[str, Any]:
        info = model.info
        return {
            "id": info.id,
            "object": "model",
            "created": self.started_at,
            "owned_by": "meshagent",
            "meshagent": {
                "architecture": info.architecture,
                "layers": info.n_layers,
                "context_length": model.engine.slot_ctx,
                "size_bytes": info.size_bytes,
                "served_by": "local",
            },
        }

    def _remote_card(self, remote: RemoteModel) -> dict[str, Any]:
        return {
            "id": remote.id,
            "object": "model",
            "created": self.started_at,
            "owned_by": "meshagent",
            "meshagent": {
                "layers": remote.layers,
                "context_length": remote.context_length,
                "served_by": remote.served_as,
                "peer": remote.peer_id,
                "stages": [list(s) for s in remote.stages],
            },
        }

    def _cards(self) -> list[dict[str, Any]]:
        models = self.directory.local_models()
        data = [self._model_card(m) for m in models]
        local = {m.info.id.casefold() for m in models}
        for remote in self.directory.remote_models():
            if remote.id.casefold() not in local:
                data.append(self._remote_card(remote))
                local.add(remote.id.casefold())
        return data

    async def _list_models(self, ex: Exchange) -> None:
        await ex.send_json(200, {"object": "list", "data": self._cards()})

    async def _ollama_tags(self, ex: Exchange) -> None:
        await ex.send_json(200, ollama.tags(self._cards()))

    async def _ollama_chat(self, ex: Exchange) -> None:
        await ollama.serve(ex, self._generate, chat=True)

    async def _ollama_generate(self, ex: Exchange) -> None:
        await ollama.serve(ex, self._generate, chat=False)

    def _local(self, name: str) -> LocalModel | None:
        return next((m for m in self.directory.local_models() if m.matches(name)), None)

    def _remote(self, name: str) -> RemoteModel | None:
        return next(iter(self._remotes(name)), None)

    def _remotes(self, name: str) -> list[RemoteModel]:
        return [r for r in self.directory.remote_models() if r.id.casefold() == name.casefold()]

    async def _metrics(self, ex: Exchange) -> None:
        await ex.send_bytes(200, self.metrics.render(), CONTENT_TYPE)

    async def _console(self, ex: Exchange) -> None:
        page = resources.files("meshagent.api").joinpath("console.html").read_bytes()
        await ex.send_bytes(200, page, "text/html; charset=utf-8")

    async def _control_events(self, ex: Exchange) -> None:
        await serve_events(ex, self.events, self._state, lambda: self.inflight.draining)

    def _state(self) -> dict[str, Any]:
        return {
            "at": time.time(),
            "status": {**self.status(), "routing": asdict(self.router.stats())},
            "peers": self.peers() if self.peers is not None else None,
        }

    async def _control_status(self, ex: Exchange) -> None:
        await ex.send_json(200, {**self.status(), "routing": asdict(self.router.stats())})

    async def _control_peers(self, ex: Exchange) -> None:
        if self.peers is None:
            raise errors.not_found("This agent has no mesh view.", code="unknown_url")
        await ex.send_json(200, self.peers())

    async def _control_probe(self, ex: Exchange) -> None:
        if self.probe is None:
            raise errors.not_found("This agent cannot probe peers.", code="unknown_url")
        body = await ex.json_body()
        if not isinstance(body, dict):
            raise errors.bad_request("The probe request must be a JSON object.")
        try:
            result = await self.probe(body)
        except (ValueError, TypeError) as e:
            raise errors.bad_request(f"Bad probe request: {e}") from e
        except trio.BrokenResourceError as e:  # includes the overlay's StreamResetError
            raise errors.unavailable(f"The probe failed: {e}", code="probe_failed") from e
        except ProbeTimeout as e:
            raise ApiError(504, str(e), type="server_error", code="probe_timeout") from e
        except MeshError as e:
            raise errors.bad_request(str(e), code="probe_failed") from e
        await ex.send_json(200, result)

    def _model(self, name: str, *, param: str | None = "model") -> LocalModel:
        model = self._local(name)
        if model is not None:
            return model
        names = [m.info.id for m in self.directory.local_models()]
        names += [r.id for r in self.directory.remote_models()]
        available = ", ".join(dict.fromkeys(names)) or "none"
        raise errors.not_found(
            f"The model '{name}' does not exist on this mesh. Available models: {available}.",
            param=param,
            code="model_not_found",
        )

    # -- generation ------------------------------------------------------------------------

    async def _await_served(self, name: str) -> None:
        """A model of this mesh that no one serves at this moment (its placement is changing
        after a lost peer) is waited for, as a replay waits, rather than reported missing;
        past the directory's bound, the request fails as temporarily unavailable."""
        if self._local(name) is not None or self._remote(name) is not None:
            return
        bound = 0.0 if self.inflight.draining else self.directory.unserved_for_now(name)
        if bound <= 0:
            return  # not this mesh's: `_model` says so
        with trio.move_on_after(bound):
            while self._local(name) is None and self._remote(name) is None:
                why = self.directory.why_unserved(name)
                if why is not None:
                    raise errors.unavailable(
                        f"The model '{name}' is not served: {why}", code="model_not_served"
                    )
                await trio.sleep(_SERVED_POLL)
            return
        raise errors.unavailable(
            f"The model '{name}' is being placed again (a peer was lost) and no agent "
            f"serves it yet after {bound:g} s; retry shortly.",
            code="split_unavailable",
            retry_after=SPLIT_RETRY_AFTER,
        )

    async def _generate(self, ex: Exchange) -> None:
        meter = self.metrics.request()
        try:
            await self._route(ex, meter)
        except ApiError as e:
            meter.fail(e.status, e.message)
            raise
        finally:
            meter.done(ex.status, client_gone=ex.disconnected)

    async def _route(self, ex: Exchange, meter: RequestMeter) -> None:
        body = await ex.json_body()
        name = body.get("model") if isinstance(body, dict) else None
        if isinstance(name, str) and (self._local(name) or self._remotes(name)):
            meter.model = name  # only models the mesh serves: a label's values stay few
        req = parse_completion(ex.path, body)
        await self._await_served(req.model)
        remotes = {r.peer_id: r for r in self._remotes(req.model)}
        local = [HERE] if self._local(req.model) is not None else []
        if not remotes:
            await self._serve(ex, prepare(req, self._model(req.model)), meter)
            return
        if not local and len(remotes) == 1:  # one peer serves it: nothing to choose
            await self._carry(ex, req, next(iter(remotes.values())), meter)
            return
        # Several replicas: the one holding the conversation takes it (`api/routing.py`).
        keys = prefix_keys(req)
        route = self.router.choose(keys, [*local, *remotes])
        with self.router.routed(route.peer, keys):
            if route.peer == HERE:
                await self._serve(ex, prepare(req, self._model(req.model)), meter)
            else:
                await self._carry(ex, req, remotes[route.peer], meter)

    async def _responses(self, ex: Exchange) -> None:
        await serve_responses(ex, self._generate, self.remembered)

    async def _embeddings(self, ex: Exchange) -> None:
        req = parse_embedding(await ex.json_body())
        texts = req.texts()
        await self._await_served(req.model)
        model = self._local(req.model)
        if model is None and (remote := self._remote(req.model)) is not None:
            # The agent serving it answers (or says why not).
            await self._forward_watched(ex, remote, EMBEDDINGS_DEADLINE)
            return
        model = self._model(req.model)
        if model.embedder is None:
            raise errors.bad_request(
                f"The model '{model.info.id}' is split across agents on this mesh, and "
                "embeddings need every layer on one agent. Give one agent the memory to "
                "serve it whole.",
                param="model",
                code="model_split",
            )
        try:
            vectors, tokens = await model.embedder.embed(texts)
        except ContextOverflow as e:
            raise errors.bad_request(str(e), param="input", code="context_length_exceeded") from e
        reply = embedding_reply(model.info.id, vectors, tokens, req.encoding_format)
        await ex.send_json(200, reply)

    def prepare_here(self, path: str, body: bytes) -> Prepared | None:
        """A completion carried here by another agent (`api/resumable.py`), prepared on the
        model this agent serves; None if it serves that model no more (or is stopping), and
        an `ApiError` if the request is bad."""
        if path not in KINDS:
            raise errors.not_found(f"Unknown endpoint POST {path}.", code="unknown_url")
        try:
            data = json.loads(body)
        except ValueError as e:  # not JSON, not UTF-8, or an integer past 4300 digits
            raise errors.bad_request(f"We could not parse the JSON body ({e}).") from e
        req = parse_completion(path, data)
        model = self._local(req.model)
        if model is None or self.inflight.draining:
            return None
        return prepare(req, model)

    async def _carry(
        self, ex: Exchange, req: CompletionKind, remote: RemoteModel, meter: RequestMeter
    ) -> None:
        """Carry the request to `remote`, a peer serving its model, and on to the next one if
        that peer is lost (`api/resumable.py`); an agent that predates that gets it over
        `api/1`; so does a request for n > 1 completions (`gen/1` carries one)."""
        if self.inflight.draining:
            raise errors.unavailable(
                "The agent is shutting down and takes no new requests.", code="shutting_down"
            )
        if req.n > 1:
            meter.path = FORWARDED
            await self._forward(ex, remote)
            return

        def here() -> Prepared | None:
            model = self._local(req.model)
            return None if model is None else prepare(req, model)

        carried = Carried(
            self.directory,
            Ask(ex.method, ex.path, ex.raw_body),
            req.model,
            self.directory.unserved_for_now(req.model),
            here,
        )
        failure: ApiError | None = None  # raised out of the nursery, not in a group
        meter.path = FORWARDED
        with self.inflight.track() as grace:
            with grace:
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                        try:
                            head = await carried.start(remote)
                            if head is None:
                                await self._forward(ex, remote)
                            else:
                                await self._relay_carried(ex, req, carried, head, meter)
                        except ApiError as e:
                            failure = e
                        nursery.cancel_scope.cancel()
                finally:
                    await carried.aclose()
            if grace.cancelled_caught:
                await self._stopped_by_shutdown(ex)
        if failure is not None:
            raise failure

    async def _relay_carried(
        self, ex: Exchange, req: CompletionKind, carried: Carried, head: Head, meter: RequestMeter
    ) -> None:
        send, events = trio.open_memory_channel[Delta | Finished | Failed](math.inf)

        async def produce() -> None:
            async with send:
                try:
                    await carried.run(send)
                except ApiError as e:
                    send.send_nowait(Failed(e))

        chat = isinstance(req, ChatCompletionRequest)
        logprobs = req.top_count() is not None
        tools = None if head.tools is None else SYNTAXES[head.tools]
        reply = Reply(chat=chat, model=head.model, logprobs=logprobs, tools=tools)
        receipt = [
            *forwarding.relayed(head.headers),
            (b"x-meshagent-served-by", carried.entry.encode()),
        ]
        meter.receipt(receipt)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            if req.stream:
                await stream_reply(
                    ex, events, reply, req.include_usage(), head.echo, receipt, meter
                )
            else:
                await whole_reply(ex, events, reply, head.echo, receipt, meter)
            nursery.cancel_scope.cancel()

    async def _forward_watched(self, ex: Exchange, remote: RemoteModel, deadline: float) -> None:
        """`_forward`, stopped when the client leaves and given up after `deadline` seconds."""
        failure: ApiError | None = None  # raised out of the nursery, not in a group
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
            with trio.move_on_after(deadline) as timer:
                try:
                    await self._forward(ex, remote)
                except ApiError as e:
                    failure = e
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if timer.cancelled_caught:
            log.warning("forward.timeout", peer=remote.peer_id, path=ex.path, seconds=deadline)
            if ex.started:  # what came is all the client gets
                if not ex.finished:
                    await ex.end()
                return
            raise ApiError(
                504,
                f"The peer serving '{remote.id}' ({remote.peer_id[:12]}) did not answer within "
                f"{deadline:g} s; retry, or send fewer inputs per request.",
                type="server_error",
                code="peer_timeout",
            )

    async def _forward(self, ex: Exchange, remote: RemoteModel) -> None:
        """The request over `api/1`: the peer's HTTP response, its body passed through."""
        try:
            stream = await self.directory.open_stream(remote.peer_id)
        except MeshError as e:
            raise errors.unavailable(
                f"The peer serving '{remote.id}' ({remote.peer_id[:12]}) is unreachable: {e}",
                code="peer_unavailable",
            ) from e
        async with stream:
            await self._relay(ex, stream, remote)

    async def _relay(self, ex: Exchange, stream: Any, remote: RemoteModel) -> None:
        frames = LengthPrefixDecoder(forwarding.FRAMING)
        try:
            await forwarding.send_request(stream, ex.method, ex.path, ex.raw_body)
            status, headers = await forwarding.read_response_head(stream, frames)
        except (MeshError, trio.BrokenResourceError) as e:
            raise errors.ApiError(
                502,
                f"The peer serving '{remote.id}' failed before answering: {e}",
                type="server_error",
                code="peer_failed",
            ) from e
        headers = [
            *forwarding.relayed(headers),
            (b"x-meshagent-served-by", remote.peer_id.encode()),
        ]
        await ex.start(status, headers)
        sse = (b"content-type", b"text/event-stream") in headers
        last = b"\n\n"
        try:
            if body_start := frames.leftover():
                await ex.send_raw(body_start)
                last = body_start
            while data := await stream.receive_some():
                await ex.send_raw(data)
                last = data
        except trio.BrokenResourceError as e:
            log.warning("forward.broken", peer=remote.peer_id, error=str(e))
            if sse:  # a stream ends with [DONE] or an error event, never just stops
                if not last.endswith(b"\n\n"):
                    await ex.send_raw(b"\n\n")
                lost = errors.unavailable(
                    f"The peer serving '{remote.id}' was lost mid-response: {e}",
                    code="split_unavailable",
                )
                await ex.send_event(lost.body())
        await ex.end()

    async def _serve(self, ex: Exchange, p: Prepared, meter: RequestMeter) -> None:
        if self.inflight.draining:
            raise errors.unavailable(
                "The agent is shutting down and takes no new requests.", code="shutting_down"
            )
        model, gen, prompt_param = p.model, p.gen, p.prompt_param
        try:
            check_fits(gen, model.engine.slot_ctx)
        except ContextOverflow as e:
            raise api_error_for(e, prompt_param=prompt_param) from e

        gen = replace(gen, sampling=gen.sampling.seeded())  # kept if the request moves
        send, events = trio.open_memory_channel[Event](math.inf)

        async def produce() -> None:
            async with send:
                tokens, chars, error = await generate_counted(model, gen, send)
                try:
                    if isinstance(error, ModelMoved):
                        await self._hand_on(ex, p, gen, (tokens, chars), error, send)
                    elif error is not None:
                        raise api_error_for(error, prompt_param=prompt_param)
                except ApiError as e:
                    send.send_nowait(Failed(e))

        if p.n > 1:
            produce = partial(produce_choices, p, gen, send)

        with self.inflight.track() as grace:
            with grace:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                    nursery.start_soon(produce)
                    receipt = self.directory.receipt(model)
                    split = any(name == b"x-meshagent-wire-dtype" for name, _ in receipt)
                    meter.path = SPLIT if split else LOCAL
                    meter.receipt(receipt)
                    logprobs = p.gen.sampling.logprobs is not None
                    tools = None if p.tools is None else p.tools.syntax
                    reply = Reply(p.chat, model.info.id, logprobs, tools, p.n)
                    if p.stream:
                        await stream_reply(
                            ex, events, reply, p.include_usage, p.echo, receipt, meter
                        )
                    else:
                        await whole_reply(ex, events, reply, p.echo, receipt, meter)
                    nursery.cancel_scope.cancel()
            if grace.cancelled_caught:
                await self._stopped_by_shutdown(ex)
            elif ex.disconnected and not ex.finished:
                log.info("request.client_gone", id=reply.id)

    async def _hand_on(
        self,
        ex: Exchange,
        p: Prepared,
        gen: GenerationRequest,
        sent: tuple[list[int], int],
        error: ModelMoved,
        out: trio.MemorySendChannel[Delta | Finished],
    ) -> None:
        """The mesh moved the model away from this agent mid-request: the request goes on at
        the entry that serves it now, from the tokens and characters sent so far."""
        name = p.model.info.id
        carried = Carried(
            self.directory,
            Ask(ex.method, ex.path, ex.raw_body, seed=gen.sampling.seed),
            name,
            self.directory.unserved_for_now(name),
            lambda: None,  # the model left this agent
            history=sent[0],
            delivered=sent[1],
            prompt_tokens=len(gen.prompt_tokens),
        )
        try:
            await carried.hand_on(str(error), out)
        finally:
            await carried.aclose()

    async def _stopped_by_shutdown(self, ex: Exchange) -> None:
        err = errors.unavailable(
            "The agent shut down before this completion finished (the shutdown grace expired).",
            code="shutting_down",
        )
        if not ex.started:
            await ex.send_error(err)
        elif not ex.finished:
            await ex.send_event(err.body())
            await ex.end()


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
