"""The ASGI application: who may ask (`api/access.py`), then the endpoint's protocol module, each a
table of routes over one request path for completions (`Completions`) and one view of the
models (`Catalog`): OpenAI's (`openai_routes.py`), the Responses API (`responses.py`),
ollama's (`ollama.py`), and the agent's own (`control_routes.py`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from meshagent.api import errors, messages
from meshagent.api.access import Access
from meshagent.api.catalog import Catalog, Loads, MeshCatalogue
from meshagent.api.completions import Completions
from meshagent.api.control_routes import CONTROL_MODEL_PREFIX, ControlRoutes, Document
from meshagent.api.errors import SPLIT_RETRY_AFTER, ApiError
from meshagent.api.events import EventHub
from meshagent.api.exchange import ClientGone, Exchange, Receive, Routes, Send
from meshagent.api.inflight import InFlight
from meshagent.api.metrics import Metrics
from meshagent.api.ollama import OllamaRoutes
from meshagent.api.openai_routes import MODEL_PREFIX, OpenAIRoutes
from meshagent.api.responses import ResponsesRoutes
from meshagent.api.routing import PrefixRouter
from meshagent.serving.directory import ModelDirectory

MESSAGES_PREFIX = "/v1/messages"  # Anthropic's endpoints answer errors in its shape

__all__ = ["SPLIT_RETRY_AFTER", "OpenAIApp"]


class OpenAIApp:
    def __init__(
        self,
        directory: ModelDirectory,
        inflight: InFlight,
        status: Callable[[], Document],
        *,
        peers: Callable[[], Document] | None = None,
        probe: Callable[[Document], Awaitable[Document]] | None = None,
        access: Access | None = None,
        catalogue: MeshCatalogue | None = None,
        loads: Loads | None = None,
    ) -> None:
        """`directory` says which models this agent serves and where the others run; `access`
        who may ask over HTTP; `status`, `peers` and `probe` answer the control API;
        `catalogue` is the mesh's catalogue of models (listed with the served ones, and
        changed through `/control/models`); `loads` meters the demand that loads them."""
        self.access = access or Access()
        self.catalog = Catalog(directory, inflight, catalogue, loads)
        self.router = PrefixRouter()
        self.events = EventHub()
        self.metrics = Metrics(status, on_request=self.events.request_ended)
        completions = Completions(self.catalog, self.metrics, self.router)
        self.openai = OpenAIRoutes(self.catalog, completions)
        self.control = ControlRoutes(
            inflight,
            status,
            peers,
            probe,
            metrics=self.metrics,
            events=self.events,
            router=self.router,
            catalogue=catalogue,
        )
        self._routes: Routes = {
            **self.openai.routes,
            **ResponsesRoutes(completions).routes,
            **messages.MessagesRoutes(completions).routes,
            **OllamaRoutes(self.catalog, completions, self.openai).routes,
            **self.control.routes,
        }

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        ex = Exchange(scope, receive, send)
        try:
            refused = self.access.refuse(ex.method, ex.path, scope.get("headers", ()))
            if refused is not None:
                raise refused
            await self._dispatch(ex)
        except ApiError as e:
            anthropic = ex.path.startswith(MESSAGES_PREFIX)  # its own error shape
            if not ex.started:
                if anthropic:
                    await ex.send_json(e.status, messages.error_body(e), e.headers())
                else:
                    await ex.send_error(e)
            elif ex.sse and not ex.finished:  # a stream opened early (kept alive): say it there
                if anthropic:
                    await ex.send_named_event("error", messages.error_body(e))
                else:
                    await ex.send_event(e.body())
                await ex.end()
        except ClientGone:
            pass

    async def _dispatch(self, ex: Exchange) -> None:
        handler = self._routes.get((ex.method, ex.path))
        if handler is not None:
            await handler(ex)
            return
        if ex.method == "GET" and ex.path.startswith(MODEL_PREFIX):
            await self.openai.model(ex, ex.path.removeprefix(MODEL_PREFIX))
            return
        if ex.method == "DELETE" and ex.path.startswith(CONTROL_MODEL_PREFIX):
            await self.control.remove_model(ex, ex.path.removeprefix(CONTROL_MODEL_PREFIX))
            return
        if any(path == ex.path for _, path in self._routes):
            raise ApiError(405, f"Method {ex.method} is not allowed on {ex.path}.")
        raise errors.not_found(f"Unknown endpoint {ex.method} {ex.path}.", code="unknown_url")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
