"""The models this agent takes part in, one `MeshModel` each, by the name the API serves.

Each model has its own placement, parts and directory (`serving/mesh_model.py`); the host puts
them side by side: one model directory for the API over all of them (`HostDirectory`), one
gossip field saying what this agent serves of each, and the split's stream labels, which
name their model (`stage/1:NAME`, `stage-reply/1:NAME`), routed to that model's split host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import structlog
import trio

from meshagent.errors import MeshError
from meshagent.gossip.peer_record import Serving
from meshagent.net.stream import MeshStream
from meshagent.placement.service import MAX_TAKES, TAKES_KEY, Snapshot
from meshagent.serving.directory import GENERATE_LABEL, Headers, RemoteModel
from meshagent.serving.foreign_models import claimed_models, foreign_models
from meshagent.serving.local_model import LocalModel
from meshagent.serving.mesh_model import MeshModel
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL

log = structlog.get_logger(__name__)

# Seconds a request waits for a model this agent takes no part in while its peers' placement
# has no plan that serves (as a request waits for a split being repaired).
FOREIGN_WAIT = 30.0


class ModelHost:
    def __init__(self, gossip: Snapshot, overlay: Any) -> None:
        self.gossip = gossip
        self.overlay = overlay
        self._models: dict[str, MeshModel] = {}  # by the model's id, casefolded
        self._scopes: dict[str, trio.CancelScope] = {}  # each model's tasks, by the same key
        self._nursery: trio.Nursery | None = None  # while `run` runs
        self.added = trio.Event()  # set (and replaced) whenever a model is added
        self.directory = HostDirectory(self)

    # ----- the models -----

    def add(self, model: MeshModel) -> None:
        """Take part in `model` from now on (started at once when the host runs)."""
        key = model.info.id.casefold()
        if key in self._models:
            raise MeshError(f"the model {model.info.id} is served here already")
        model.published = self.publish_serving
        self._models[key] = model
        if self._nursery is not None:
            self.publish_takes()
            self._nursery.start_soon(self._run_model, model)
        self.added.set()
        self.added = trio.Event()

    async def remove(self, name: str) -> None:
        """Take no part in `name` from now on (removed from the catalogue): no plans, and its
        part here let go once the requests in flight on it finish (within the grace)."""
        model = self._models.get(name.casefold())
        if model is None:
            return
        model.placement.stop()
        await model.stand_down()
        del self._models[name.casefold()]
        scope = self._scopes.pop(name.casefold(), None)
        if scope is not None:
            scope.cancel()
        self.publish_takes()
        self.publish_serving()
        self.added.set()  # (what the directory answers changed)
        self.added = trio.Event()

    def get(self, name: str) -> MeshModel | None:
        return self._models.get(name.casefold())

    def __iter__(self) -> Iterator[MeshModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    @property
    def names(self) -> list[str]:
        return [m.info.id for m in self._models.values()]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.publish_takes()
        async with trio.open_nursery() as nursery:
            for model in self:
                await nursery.start(self._run_model, model)
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def _run_model(
        self, model: MeshModel, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self._scopes[model.info.id.casefold()] = scope
            await model.run(task_status=task_status)

    def stop(self) -> None:
        """This agent is leaving: no model proposes plans or takes parts from now on."""
        for model in self:
            model.placement.stop()

    def close_runners(self) -> None:
        """Refuse new work on every model served here (the agent drains)."""
        for model in self:
            if model.local is not None:
                model.local.runner.close()

    async def aclose(self) -> None:
        for model in self:
            await model.aclose()

    async def end_idle_streams(self) -> None:
        """This agent is leaving: end each split stream it serves or sends on once it is
        idle (`SplitHost.end_idle_streams`); returns when all have ended."""
        async with trio.open_nursery() as nursery:
            for model in self:
                if model.parts.split is not None:
                    nursery.start_soon(model.parts.split.end_idle_streams)

    # ----- the overlay -----

    def handlers(self) -> dict[str, Any]:
        """A split's streams go to the model their label names (the rest of the label after
        the first ':'); a model not taken part in here, or none named, is refused."""

        async def to_model(stream: MeshStream) -> None:
            _, _, name = stream.label.partition(":")
            model = self.get(name) if name else None
            if model is None:
                stream.reset(f"this agent runs no part of a split of {name[:80]!r}")
                return
            await model.to_split(stream)

        return {STAGE_LABEL: to_model, REPLY_LABEL: to_model}

    # ----- gossip -----

    def serving_record(self) -> tuple[Serving, ...]:
        return tuple(s for model in self for s in model.serving_record())

    def publish_takes(self) -> None:
        """Tell the mesh which models this agent takes part in: placement plans a model only
        on the peers that do (`placement.service.takes_part`)."""
        me = self.gossip.snapshot().get(self.gossip.peer_id)
        extras = dict(me.record.extras) if me is not None else {}
        extras[TAKES_KEY] = self.names[:MAX_TAKES]
        self.gossip.update_local(extras=extras)

    def publish_serving(self) -> None:
        """Tell the mesh what this agent serves of each model (`meshagent peers`' SERVES)."""
        try:
            self.gossip.update_local(serving=self.serving_record())
        except MeshError as e:
            log.warning("model_host.publish_serving_failed", error=str(e))


class HostDirectory:
    """The model directory (`serving/directory.py`) over every model of the host."""

    def __init__(self, host: ModelHost) -> None:
        self._host = host

    def _directories(self) -> Sequence[Any]:
        return [m.directory for m in self._host]

    def local_models(self) -> list[LocalModel]:
        return [m for d in self._directories() for m in d.local_models()]

    def remote_models(self) -> list[RemoteModel]:
        here = [r for d in self._directories() for r in d.remote_models()]
        hosted = {n.casefold() for n in self._host.names}
        return here + foreign_models(self._host.gossip.snapshot(), hosted)

    def unserved_for_now(self, name: str) -> float:
        if self._host.get(name) is None:  # a model of peers whose placement is changing
            claimed = {m.casefold() for m in claimed_models(self._host.gossip.snapshot())}
            return FOREIGN_WAIT if name.casefold() in claimed else 0.0
        return max((d.unserved_for_now(name) for d in self._directories()), default=0.0)

    def why_unserved(self, name: str) -> str | None:
        model = self._host.get(name)
        return model.directory.why_unserved(name) if model is not None else None

    def receipt(self, model: LocalModel) -> Headers:
        for d in self._directories():
            if model in d.local_models():
                return d.receipt(model)
        return []

    async def changed(self) -> None:
        """Until any model's directory may have changed, or a model is added."""
        added = self._host.added
        async with trio.open_nursery() as nursery:

            async def wake(changed: Any) -> None:
                await changed()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wake, added.wait)
            for d in self._directories():
                nursery.start_soon(wake, d.changed)

    async def open_stream(self, peer_id: str, label: str = GENERATE_LABEL) -> MeshStream:
        return await self._host.overlay.open_stream(peer_id, label)
