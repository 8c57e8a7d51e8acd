"""The models the API answers for, looked up in the model directory by the name a client gives:
served here, served by peers, described as model cards, or (placed again after a lost peer)
waited for. The cards list the mesh's catalogue too (`MeshCatalogue`): a catalogued model no
agent serves yet has a card that says so."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import trio

from meshagent.api import errors
from meshagent.api.errors import SPLIT_RETRY_AFTER
from meshagent.api.gen_moves import Rejoins
from meshagent.api.inflight import InFlight
from meshagent.catalog.entry import CatalogEntry, SignedEntry
from meshagent.serving.directory import ModelDirectory, RemoteModel
from meshagent.serving.local_model import LocalModel
from meshagent.wording import not_served

_SERVED_POLL = 0.1  # seconds between looks for a model being placed again


class MeshCatalogue(Protocol):
    """The mesh's catalogue of models as the API reads and changes it
    (`meshagent.catalog.service.Catalog` fits)."""

    def entries(self) -> Mapping[str, CatalogEntry]:
        """Each catalogued model, by name."""
        ...

    def signed_entries(self) -> Sequence[SignedEntry]:
        """The same, with who added each."""
        ...

    async def add(
        self, spec: str, progress: Callable[[int, int], None] | None = None
    ) -> SignedEntry:
        """Add the model a path or hub name gives (ModelError, CatalogError); `progress`
        hears of a download (on a worker thread)."""
        ...

    def remove(self, name: str) -> SignedEntry:
        """Remove a catalogued model (NotCatalogued when it is not)."""
        ...


class Loads(Protocol):
    """Demand for the mesh's models, metered where requests arrive: the mesh loads a model on
    its first request and unloads it after its keep_alive (`serving/assigning.py`)."""

    load_timeout: float  # seconds a request waits for its model to load

    def begin(self, model_id: str) -> None: ...

    def end(self, model_id: str, tokens: int, keep_alive: float | None = None) -> None: ...

    def why_not_placed(self, name: str) -> str | None:
        """Why the mesh places the model nowhere now (no memory for it, say), if so."""
        ...

    def may_yet_place(self, name: str) -> bool:
        """Whether the mesh may yet place the model whatever it says now: peers are still
        taking it up (hashing its file), or models in use hold its memory until they go
        idle. A request waits on then, within its load timeout."""
        ...

    def expires_at(self, name: str) -> float | None:
        """When the model unloads (unix time; inf: never, pinned or keep_alive < 0), as the
        mesh's demand says; None when it does not say."""
        ...


# Seconds a request for a model being loaded waits before a reason for not placing it is
# believed: the request's own demand must reach the mesh's assignment first.
LOAD_SETTLE = 5.0
LOAD_RETRY_AFTER = 30


class Catalog:
    def __init__(
        self,
        directory: ModelDirectory,
        inflight: InFlight,
        catalogue: MeshCatalogue | None = None,
        loads: Loads | None = None,
    ) -> None:
        self.directory = directory
        self.inflight = inflight
        self.rejoins = Rejoins()  # completions carried here that their askers may rejoin
        self.catalogue = catalogue
        self.loads = loads
        self.started_at = int(time.time())

    def must_load(self, name: str) -> bool:
        """A catalogued model no agent serves now, which a request would wait for."""
        return (
            self.loads is not None
            and self.catalogued(name) is not None
            and self.local(name) is None
            and self.remote(name) is None
        )

    def known(self, name: str) -> bool:
        """Whether the mesh has that model: served here or by a peer, or catalogued."""
        return bool(self.local(name) or self.remotes(name) or self.catalogued(name))

    def catalogued(self, name: str) -> str | None:
        """The catalogue's name for `name` (compared without case), if it holds that model."""
        if self.catalogue is None:
            return None
        return next((n for n in self.catalogue.entries() if n.casefold() == name.casefold()), None)

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
        """A model of this mesh that no one serves at this moment is waited for rather than
        reported missing: one being placed again after a lost peer, as a replay waits (past
        the directory's bound, the request fails as temporarily unavailable), and a
        catalogued one the mesh loads for this request (`await_loaded`)."""
        if self.local(name) is not None or self.remote(name) is not None:
            return
        if self.must_load(name):
            await self.await_loaded(name)
            return
        bound = 0.0 if self.inflight.draining else self.directory.unserved_for_now(name)
        if bound <= 0:
            return  # not this mesh's: `model` says so
        with trio.move_on_after(bound):
            while self.local(name) is None and self.remote(name) is None:
                why = self.directory.why_unserved(name)
                if why is not None:
                    raise errors.unavailable(
                        f"The model {not_served(name, why)}", code="model_not_served"
                    )
                await trio.sleep(_SERVED_POLL)
            return
        raise errors.unavailable(
            f"The model '{name}' is being placed (at start, or again after a lost peer) and "
            f"no agent serves it yet after {bound:g} s; retry shortly.",
            code="split_unavailable",
            retry_after=SPLIT_RETRY_AFTER,
        )

    async def await_loaded(self, name: str) -> None:
        """A catalogued model no agent serves now: the request's demand (`Loads.begin`, in
        `Completions`) has the mesh load it; wait until some agent serves it, within the
        load timeout. A reason the mesh cannot place it (no memory anywhere) that still holds
        once the demand reached the assignment ends the wait with a 503 saying so."""
        assert self.loads is not None
        if self.inflight.draining:
            raise errors.unavailable(
                f"The model '{name}' is not loaded and this agent is shutting down.",
                code="shutting_down",
            )
        began = trio.current_time()
        timeout = self.loads.load_timeout
        with trio.move_on_after(timeout):
            while self.local(name) is None and self.remote(name) is None:
                settled = trio.current_time() - began >= LOAD_SETTLE
                if settled and not self.loads.may_yet_place(name):
                    why = self.loads.why_not_placed(name) or self.directory.why_unserved(name)
                    if why is not None:
                        raise errors.unavailable(
                            f"The model {not_served(name, why)}",
                            code="model_not_served",
                            retry_after=LOAD_RETRY_AFTER,
                        )
                with trio.move_on_after(LOAD_SETTLE / 5):
                    await self.directory.changed()
            return
        raise errors.unavailable(
            f"The model '{name}' did not load within {timeout:g} s (--load-timeout); retry "
            "shortly.",
            code="model_loading",
            retry_after=LOAD_RETRY_AFTER,
        )

    # -- model cards (`GET /v1/models`) --

    def cards(self) -> list[dict[str, Any]]:
        """A card for each model of the mesh: this agent's own first, then the peers', then
        the catalogued models no agent serves."""
        catalogued = self._catalogued()
        models = self.directory.local_models()
        data = [self._local_card(m, catalogued) for m in models]
        seen = {m.info.id.casefold() for m in models}
        for remote in self.directory.remote_models():
            if remote.id.casefold() not in seen:
                data.append(self._remote_card(remote, catalogued))
                seen.add(remote.id.casefold())
        for key, entry in catalogued.items():
            if key not in seen:
                data.append(self._catalogued_card(entry))
        return data

    def card(self, name: str) -> dict[str, Any]:
        """The card of the model of that name; 404 if the mesh has none."""
        catalogued = self._catalogued()
        remote = self.remote(name)
        if remote is not None and self.local(name) is None:
            return self._remote_card(remote, catalogued)
        entry = catalogued.get(name.casefold())
        if entry is not None and self.local(name) is None:
            return self._catalogued_card(entry)
        return self._local_card(self.model(name, param=None), catalogued)

    def _catalogued(self) -> dict[str, CatalogEntry]:
        """The catalogue by name without case (empty where the app has none)."""
        if self.catalogue is None:
            return {}
        return {name.casefold(): e for name, e in self.catalogue.entries().items()}

    def _catalogued_card(self, entry: CatalogEntry) -> dict[str, Any]:
        return {
            "id": entry.name,
            "object": "model",
            "created": entry.time,
            "owned_by": "meshagent",
            "meshagent": {
                "catalogued": True,
                "loaded": False,
                "architecture": entry.architecture,
                "layers": entry.n_layers,
                "size_bytes": entry.size,
                "sha256": entry.sha256,
            },
        }

    def _local_card(self, model: LocalModel, catalogued: Mapping[str, object]) -> dict[str, Any]:
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
                "catalogued": info.id.casefold() in catalogued,
                "loaded": True,
            },
        }

    def _remote_card(
        self, remote: RemoteModel, catalogued: Mapping[str, CatalogEntry]
    ) -> dict[str, Any]:
        entry = catalogued.get(remote.id.casefold())
        known = (  # what the catalogue says of the file, where it holds the model
            {"architecture": entry.architecture, "size_bytes": entry.size, "sha256": entry.sha256}
            if entry is not None
            else {}
        )
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
                "catalogued": entry is not None,
                "loaded": True,
                **known,
            },
        }
