"""This agent's model in the mesh: placement decides whether this agent serves it whole, runs
one stage of a split, or only routes requests to the peers that do.

`MeshModel` puts together the roles, each an object of its own:
- `PlacementService` (placement/service.py) agrees on the plan with the mesh;
- `Parts` (serving/parts.py) follows the plan: loads this agent's part, serves it, lets it go;
- `MeshDirectory` (serving/mesh_directory.py) is the model directory the API asks: what is
  offered here, and which peers serve the model otherwise;
- `Rerouting` (serving/recovery.py) finds what serves the model again for a request that
  lost its chain, and interrupts a split's requests when its plan stops being routable;
- `ArtifactSource` (serving/obtain.py) gets the artifacts a part needs and, as a spare, cuts
  a split's stages ahead of time.
Besides, it tells the mesh what this agent serves, and allows splits of a family split only
once certified as soon as a capability record arrives.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import structlog
import trio

from meshagent.capacity import offered_memory
from meshagent.errors import MeshError
from meshagent.gossip.peer_record import Serving
from meshagent.models.family import family_traits
from meshagent.net.errors import ConnectionUnavailable
from meshagent.net.stream import MeshStream
from meshagent.placement.negotiation import plan_digest
from meshagent.placement.planner import ModelCost, Plan
from meshagent.placement.service import PlacementService, Snapshot
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.draft_loading import FindDraft
from meshagent.serving.mesh_directory import MeshDirectory
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.obtain import ArtifactSource, needed_by
from meshagent.serving.parts import Parts
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL
from meshagent.serving.recovery import Rerouting
from meshagent.serving.settings import ServingSettings

log = structlog.get_logger(__name__)

_SPARE_CUT_INTERVAL = 2.0  # seconds between a spare's looks for stages to cut ahead of time


class MeshModel:
    def __init__(
        self,
        *,
        peer_id: str,
        files: ModelFiles,
        overlay: Any,
        gossip: Snapshot,
        capabilities: Capabilities,
        settings: ServingSettings,
        reach: Callable[[str], Awaitable[None]] | None = None,
        find_draft: FindDraft | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.files = files
        self.info, self.layout = files.info, files.layout
        self.overlay = overlay
        self._reach = reach  # connect to a peer now (the dialer), for a stream that must go
        self.settings = settings
        self.capabilities = capabilities
        self.cost = ModelCost.from_layout(files.info.id, files.layout)
        self.source = ArtifactSource(
            peer_id=peer_id,
            model_path=files.path,
            layout=files.layout,
            store=files.store,
            views=lambda: self.placement.gossip.snapshot(),
            open_stream=self._open_stream,
        )
        self.placement = PlacementService(
            gossip,
            self.cost,
            context_tokens=settings.slots * settings.slot_ctx,
            take_part=self._take_part,
            release=self._release,
            headroom=settings.headroom,
            threshold=settings.threshold,
        )
        self.directory = MeshDirectory(
            peer_id=peer_id,
            info=files.info,
            layout=files.layout,
            placement=self.placement,
            overlay=overlay,
            settings=settings,
        )
        self.rerouting = Rerouting(peer_id, self.placement, self.directory)
        self.parts = Parts(
            peer_id=peer_id,
            files=files,
            source=self.source,
            placement=self.placement,
            capabilities=capabilities,
            directory=self.directory,
            rerouting=self.rerouting,
            settings=settings,
            open_stream=self._open_stream,
            published=self.publish_serving,
            find_draft=find_draft,
        )
        # Tells the mesh what this agent serves (`ModelHost.publish_serving`, for every model
        # served here); alone, this model's part only.
        self.published: Callable[[], None] = self._publish_own

    # ----- what the agent wires -----

    async def to_split(self, stream: MeshStream) -> None:
        """A stage or reply stream of this model's split (`ModelHost` routes them by label)
        goes to the split host of the moment, which refuses the kind it does not serve."""
        split = self.parts.split
        if split is None:
            stream.reset("this agent runs no part of a split")
        elif stream.label.startswith(STAGE_LABEL):
            await split.handle_stage(stream)
        else:
            await split.handle_reply(stream)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.parts.run)
            await nursery.start(self.placement.run)
            nursery.start_soon(self.rerouting.watch, self._interrupt)
            nursery.start_soon(self._watch_certification)
            nursery.start_soon(self._cut_as_spare)
            task_status.started()
            await trio.sleep_forever()

    def _interrupt(self, why: str) -> None:
        split = self.parts.split
        if split is not None and split.pipeline is not None:
            split.pipeline.interrupt(why)

    async def _take_part(self, plan: Any) -> None:
        await self.parts.take(plan.chain_of(self.peer_id))  # a split's chain this agent is in

    async def _release(self, plan: Any) -> None:
        await self.parts.release(plan.chain_of(self.peer_id))

    async def _watch_certification(self) -> None:
        """A family the stage engine runs but the planner splits only once certified (hybrid
        and recurrent models): allow splits as soon as a capability record for this model
        file is known, certified here or heard from a peer (woken by each change gossip
        brings)."""
        if self.cost.split_refusal is None or not family_traits(self.layout).certifiable:
            return
        sha = await trio.to_thread.run_sync(lambda: self.files.store.source_sha256(self.files.path))
        while True:
            signed = self.capabilities.for_model(sha)
            if signed is not None and signed.record.exact_dtypes():
                self.cost = replace(self.cost, split_refusal=None)
                self.placement.cost = self.cost
                log.info(
                    "mesh_model.certified",
                    model=self.info.id,
                    exact=list(signed.record.exact_dtypes()),
                    certifier=signed.record.certifier,
                )
                return
            await self.placement.changed.wait()

    async def _cut_as_spare(self) -> None:
        """While a split serves, keep this agent's artifacts: as a spare offering memory, cut
        (or fetch) that split's stages here ahead of time, so that a repair giving this agent
        a lost stage only loads it; and once per plan, delete what it no longer needs."""
        failed: set[tuple[str, int, int]] = set()
        pruned = ""
        while True:
            await trio.sleep(_SPARE_CUT_INTERVAL)
            claim = self.placement.in_force
            me = self.placement.gossip.snapshot().get(self.peer_id)
            if claim is None or not self.placement.routable or me is None:
                continue  # nothing settled to prepare for (or a repair is using the CPU)
            if offered_memory(me.record) > 0:
                await self.source.prepare_spare(claim.plan, failed, self._routable)
            if pruned != (digest := plan_digest(claim.plan)) and self.placement.routable:
                await trio.to_thread.run_sync(self.source.prune, claim.plan)
                pruned = digest

    def _routable(self) -> bool:
        return self.placement.routable

    def in_plan(self, key: str) -> bool:
        """Whether artifact `key` is part of the split in force (a peer may have it cut here
        from the whole file: `transfer.ArtifactServer`)."""
        claim = self.placement.in_force
        return claim is not None and needed_by(claim.plan, key)

    # ----- what the agent reports -----

    @property
    def local(self) -> Any:
        """The model this agent serves (whole, or as a split's entry), if any."""
        return self.parts.local

    def layers(self) -> tuple[int, int]:
        """The layers of the model this agent runs: all of them unless it holds a stage."""
        return self.parts.layers()

    def serving_record(self) -> tuple[Serving, ...]:
        """What this agent serves now, as its gossip record says: the whole model or its
        stage, once loaded; nothing otherwise."""
        if self.parts.local is None and self.parts.split is None:
            return ()
        a, b = self.layers()
        sha = self.placement.source_sha256  # the model file's, once measured
        return (Serving(self.info.id, sha, a, b, self.layout.n_layers),)

    def publish_serving(self) -> None:
        """Tell the mesh what this agent serves (`meshagent peers`' SERVES column)."""
        self.published()

    def _publish_own(self) -> None:
        try:
            self.placement.gossip.update_local(serving=self.serving_record())
        except MeshError as e:
            log.warning("mesh_model.publish_serving_failed", error=str(e))

    def placement_summary(self) -> dict[str, Any]:
        """The plan in force and whether it can serve, for the agent's status."""
        claim = self.placement.in_force
        if claim is None:
            return {
                "epoch": None,
                "routable": False,
                "replicas": [],
                "stages": [],
                "chains": [],
                "error": self.placement.error,
            }
        plan = claim.plan
        wire = self.parts.wire
        return {
            "epoch": claim.epoch,
            "proposer": claim.proposer,
            "routable": self.placement.routable,
            "replicas": list(plan.replicas),
            "stages": [[s.peer_id, s.start, s.end] for s in plan.stages],
            # a split's further chains, each as `stages` (requests go to any that serves)
            "chains": [[[s.peer_id, s.start, s.end] for s in c] for c in plan.chains],
            "est_token_ms": round(plan.est_token_ms, 2),
            "wire_dtype": wire.dtype if plan.split and wire else None,
            "wire": wire.to_dict() if plan.split and wire else None,
            # peers of the plan that have not loaded their part yet (or are gone)
            "loading": [p for p in plan.peers if p not in self.placement.ready],
            "error": self.placement.error,
        }

    async def _open_stream(self, peer_id: str, label: str, **window: int) -> MeshStream:
        """A stream of the split to `peer_id`; a peer this agent lost its connection to (it
        crashed and came back, say) is dialled at once rather than on the dialer's backoff.
        A split's labels name the model (`ModelHost.handlers`)."""
        if label in (STAGE_LABEL, REPLY_LABEL):
            label = f"{label}:{self.info.id}"
        try:
            return await self.overlay.open_stream(peer_id, label, **window)
        except ConnectionUnavailable:
            if self._reach is None:
                raise
            await self._reach(peer_id)
            return await self.overlay.open_stream(peer_id, label, **window)

    async def stand_down(self) -> None:
        """Serve nothing of this model here any more: the requests in flight on its part
        finish first (within the grace), then it unloads."""
        await self.parts.release(Plan(self.info.id, 0))

    async def aclose(self) -> None:
        await self.parts.unload()
