"""The models the API answers for, looked up in the model directory by the name a client gives:
served here, served by peers, described as model cards, or (placed again after a lost peer)
waited for."""

from __future__ import annotations

import time
from typing import Any

import trio

from meshagent.api import errors
from meshagent.api.errors import SPLIT_RETRY_AFTER
from meshagent.api.inflight import InFlight
from meshagent.serving.directory import ModelDirectory, RemoteModel
from meshagent.serving.local_model import LocalModel

_SERVED_POLL = 0.1  # seconds between looks for a model being placed again


class Catalog:
    def __init__(self, directory: ModelDirectory, inflight: InFlight) -> None:
        self.directory = directory
        self.inflight = inflight
        self.started_at = int(time.time())

    def local(self, name: str) -> LocalModel | None:
        """The model of that name this agent serves, if it serves one."""
        return next((m for m in self.directory.local_models() if m.matches(name)), None)

    def remotes(self, name: str) -> list[RemoteModel]:
        """Each peer that serves a model of that name."""
        return [r for r in self.directory.remote_models() if r.id.casefold() == name.casefold()]

    def remote(self, name: str) -> RemoteModel | None:
        return next(iter(self.remotes(name)), None)

    def model(self, name: str, *, param: str | None = "model") -> LocalModel:
        """The model of that name this agent serves; 404 naming the mesh's models if none."""
        model = self.local(name)
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

    async def await_served(self, name: str) -> None:
        """A model of this mesh that no one serves at this moment (its placement is changing
        after a lost peer) is waited for, as a replay waits, rather than reported missing;
        past the directory's bound, the request fails as temporarily unavailable."""
        if self.local(name) is not None or self.remote(name) is not None:
            return
        bound = 0.0 if self.inflight.draining else self.directory.unserved_for_now(name)
        if bound <= 0:
            return  # not this mesh's: `model` says so
        with trio.move_on_after(bound):
            while self.local(name) is None and self.remote(name) is None:
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

    # -- model cards (`GET /v1/models`) --

    def cards(self) -> list[dict[str, Any]]:
        """A card for each model of the mesh: this agent's own first, then the peers'."""
        models = self.directory.local_models()
        data = [self._local_card(m) for m in models]
        seen = {m.info.id.casefold() for m in models}
        for remote in self.directory.remote_models():
            if remote.id.casefold() not in seen:
                data.append(self._remote_card(remote))
                seen.add(remote.id.casefold())
        return data

    def card(self, name: str) -> dict[str, Any]:
        """The card of the model of that name; 404 if the mesh has none."""
        remote = self.remote(name)
        if remote is not None and self.local(name) is None:
            return self._remote_card(remote)
        return self._local_card(self.model(name, param=None))

    def _local_card(self, model: LocalModel) -> dict[str, Any]:
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
