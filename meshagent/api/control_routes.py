"""The agent's own endpoints for its user: `/health`, `/metrics`, the console's page and events,
and the control API (`/control/status`, `/control/peers`, `/control/probe`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from importlib import resources
from typing import Any

import trio

from meshagent.api import errors
from meshagent.api.errors import ApiError
from meshagent.api.events import EventHub, serve_events
from meshagent.api.exchange import Exchange, Routes
from meshagent.api.inflight import InFlight
from meshagent.api.metrics import CONTENT_TYPE, Metrics
from meshagent.api.routing import PrefixRouter
from meshagent.discovery.probe import ProbeTimeout
from meshagent.errors import MeshError

Document = dict[str, Any]


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
    ) -> None:
        self.inflight = inflight
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
