"""The agent's own endpoints for its user: `/health`, `/metrics`, the console's page and events,
and the control API (`/control/status`, `/control/peers`, `/control/probe`, and the mesh's
catalogue of models: `/control/models`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from importlib import resources
from typing import Any

import trio

from meshagent.api import errors
from meshagent.api.catalog import MeshCatalogue
from meshagent.api.errors import ApiError
from meshagent.api.events import EventHub, serve_events
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.inflight import InFlight
from meshagent.api.metrics import CONTENT_TYPE, Metrics
from meshagent.api.routing import PrefixRouter
from meshagent.discovery.probe import ProbeTimeout
from meshagent.errors import CatalogError, MeshError, ModelError, NotCatalogued

Document = dict[str, Any]
CONTROL_MODELS = "/control/models"
CONTROL_MODEL_PREFIX = CONTROL_MODELS + "/"  # `DELETE /control/models/{name}`
_MAX_SPEC = 4096  # characters of a model's path or name


class ControlRoutes:
    def __init__(
        self,
        inflight: InFlight,
        status: Callable[[], Document],
        peers: Callable[[], Document] | None,
        probe: Callable[[Document], Awaitable[Document]] | None,
        *,
        metrics: Metrics,
        events: EventHub,
        router: PrefixRouter,
        catalogue: MeshCatalogue | None = None,
    ) -> None:
        self.inflight = inflight
        self.catalogue = catalogue
        self.status = status
        self.peers = peers
        self.probe = probe
        self.metrics = metrics
        self.events = events
        self.router = router
        self.routes: Routes = {
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/console"): self._console,
            ("GET", "/control/events"): self._control_events,
            ("GET", "/control/status"): self._control_status,
            ("GET", "/control/peers"): self._control_peers,
            ("POST", "/control/probe"): self._control_probe,
            ("GET", CONTROL_MODELS): self._catalogue,
            ("POST", CONTROL_MODELS): self._add_model,
        }

    async def _health(self, ex: Exchange) -> None:
        if self.inflight.draining:
            await ex.send_json(503, {"status": "draining"})
        else:
            await ex.send_json(200, {"status": "ok"})

    async def _metrics(self, ex: Exchange) -> None:
        await ex.send_bytes(200, self.metrics.render(), CONTENT_TYPE)

    async def _console(self, ex: Exchange) -> None:
        page = resources.files("meshagent.api").joinpath("console.html").read_bytes()
        await ex.send_bytes(200, page, "text/html; charset=utf-8")

    async def _control_events(self, ex: Exchange) -> None:
        await serve_events(ex, self.events, self._state, lambda: self.inflight.draining)

    def _status(self) -> Document:
        return {**self.status(), "routing": asdict(self.router.stats())}

    def _state(self) -> Document:
        peers = self.peers() if self.peers is not None else None
        return {"at": time.time(), "status": self._status(), "peers": peers}

    async def _control_status(self, ex: Exchange) -> None:
        await ex.send_json(200, self._status())

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

    def _mesh_catalogue(self) -> MeshCatalogue:
        if self.catalogue is None:
            raise errors.not_found("This agent has no catalogue of models.", code="unknown_url")
        return self.catalogue

    async def _catalogue(self, ex: Exchange) -> None:
        """`GET /control/models`: the mesh's catalogue as this agent knows it."""
        entries = self._mesh_catalogue().signed_entries()
        await ex.send_json(200, {"models": [s.to_dict() for s in entries]})

    async def _add_model(self, ex: Exchange) -> None:
        """`POST /control/models {"model": PATH_OR_NAME}`: resolve the model here (a hub
        name may download, off the event loop: other requests go on), sign its entry and
        gossip it; answers the entry."""
        catalogue = self._mesh_catalogue()
        body = await ex.json_body()
        spec = body.get("model") if isinstance(body, dict) else None
        if not isinstance(spec, str) or not spec.strip() or len(spec) > _MAX_SPEC:
            raise errors.bad_request(
                'Send {"model": PATH_OR_NAME}: a GGUF file on this agent\'s machine or a '
                "Hugging Face name (ORG/REPO, ORG/REPO:QUANT or ORG/REPO/FILE.gguf).",
                param="model",
            )
        try:
            signed = await catalogue.add(spec.strip())
        except ModelError as e:
            raise errors.bad_request(str(e), param="model", code="model_unavailable") from e
        except CatalogError as e:
            raise errors.bad_request(str(e), param="model", code="catalog_refused") from e
        await ex.send_json(200, signed.to_dict())

    async def remove_model(self, ex: Exchange, name: str) -> None:
        """`DELETE /control/models/{name}`: a signed tombstone, gossiped; 404 when no model
        of that name is catalogued."""
        catalogue = self._mesh_catalogue()
        try:
            signed = catalogue.remove(name)
        except NotCatalogued as e:
            raise errors.not_found(
                f"The model '{name[:200]}' is not in the mesh's catalogue.",
                code="model_not_found",
            ) from e
        except CatalogError as e:
            raise errors.bad_request(str(e), code="catalog_refused") from e
        await ex.send_json(200, signed.to_dict())
