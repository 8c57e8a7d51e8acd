"""This agent's model in the mesh: placement decides whether this agent serves it whole, runs
one stage of a split, or only routes requests to the peers that do.

`MeshModel` owns the placement service for the model, loads what the plan in force gives this
agent (a whole `LocalModel`, or a `SplitHost`'s part), and is the agent's model directory
(`serving/directory.py`): the API asks it which model is served here, with which receipt, and
which peer serves the model when this agent does not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
import trio

from meshagent.capacity import offered_memory
from meshagent.config import PREFIX_CACHE_AUTO, prefix_budget
from meshagent.engine.base import ModelInfo
from meshagent.engine.llama import LlamaEngine
from meshagent.errors import EngineError, MeshError, ModelMoved
from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import Serving
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.capability import WireChoice, choose_wire_dtype
from meshagent.models.family import family_traits
from meshagent.models.layout import ModelLayout
from meshagent.net.errors import ConnectionUnavailable
from meshagent.net.stream import MeshStream
from meshagent.placement.negotiation import plan_digest
from meshagent.placement.planner import ModelCost, Plan, offloaded_layers
from meshagent.placement.service import PlacementService, Snapshot
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.directory import FORWARD_LABEL, Headers, RemoteModel
from meshagent.serving.embeddings import Embedder
from meshagent.serving.generation import Route
from meshagent.serving.local_model import LocalModel
from meshagent.serving.obtain import ArtifactSource, needed_by
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL
from meshagent.serving.split_host import SplitHost, SplitSettings

log = structlog.get_logger(__name__)

# Seconds a reason for not serving must hold before it is said (the startup line, the API):
# while an agent starts, its own memory is not yet counted and the mesh looks empty.
UNSERVED_SETTLE = 3.0
_WATCH_INTERVAL = 0.5  # seconds between checks that the split in force is still routable
_CERTIFICATION_INTERVAL = 2.0  # seconds between looks for a record that allows a split
_RECORD_WAIT = 10.0  # seconds a stage of a certified-only split waits for the record
_REROUTE_POLL = 0.05  # seconds between looks for what serves a request being replayed
_SPARE_CUT_INTERVAL = 2.0  # seconds between a spare's looks for stages to cut ahead of time
# A split's entry keeps prefixes within this share of each stage's free bytes: its size of a
# prefix is an estimate, and a stage refuses past what it has free (`SplitSettings`).
_STAGE_SHARE = 0.75


@dataclass(frozen=True)
class MeshModelSettings:
    slots: int
    slot_ctx: int
    threads: int
    max_queue: int
    wire_dtype: str = "auto"  # --wire-dtype: auto, f16 or f32
    replay_deadline: float = 30.0  # seconds a request waits for its split to serve again
    speculation: str = "auto"  # --speculation, for requests that do not choose
    prefix_cache: int = PREFIX_CACHE_AUTO  # --prefix-cache: bytes, 0 (off) or auto
    vram: int = 0  # GPU memory offered here (`--max-vram`), all devices together
    headroom: float = 0.1
    threshold: float = 0.25


class MeshModel:
    def __init__(
        self,
        *,
        peer_id: str,
        model_path: Path,
        layout: ModelLayout,
        info: ModelInfo,
        store: ArtifactStore,
        overlay: Any,
        gossip: Snapshot,
        capabilities: Capabilities,
        settings: MeshModelSettings,
        reach: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.model_path = model_path
        self.layout = layout
        self.info = info
        self.store = store
        self.overlay = overlay
        self._reach = reach  # connect to a peer now (the dialer), for a stream that must go
        self.settings = settings
        self.capabilities = capabilities
        self.wire: WireChoice | None = None  # the split's wire dtype, when in one
        self.cost = ModelCost.from_layout(info.id, layout)
        self.source = ArtifactSource(
            peer_id=peer_id,
            model_path=model_path,
            layout=layout,
            store=store,
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
        self.local: LocalModel | None = None  # what this agent serves, whole or as entry
        self.split: SplitHost | None = None
        # What the directory lists: `local` once its runner runs, with its receipt.
        self._offered: LocalModel | None = None
        self._receipt: Headers = []
        self._offers = trio.Event()  # set (and replaced) whenever `_offered` is set
        self._offered_plan: Plan | None = None  # the plan `_offered` serves (or last served)
        self._replaced: tuple[Plan, float] | None = None  # the plan before it, and until when
        self._whole: LlamaEngine | None = None
        self._nursery: trio.Nursery | None = None
        self._serving_scope: trio.CancelScope | None = None
        self._served = trio.Event()

    # ----- what the agent wires -----

    def handlers(self) -> dict[str, Any]:
        """Stage and reply streams go to the split host of the moment (SplitHost refuses the
        kind it does not serve)."""

        async def to_split(stream: Any) -> None:
            if self.split is None:
                stream.reset("this agent runs no part of a split")
            elif stream.label.startswith(STAGE_LABEL):
                await self.split.handle_stage(stream)
            else:
                await self.split.handle_reply(stream)

        return {STAGE_LABEL: to_split, REPLY_LABEL: to_split}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.placement.run)
            nursery.start_soon(self._watch_split)
            nursery.start_soon(self._watch_certification)
            nursery.start_soon(self._cut_as_spare)
            task_status.started()
            await trio.sleep_forever()

    async def _watch_split(self) -> None:
        """As the entry of a split, fail the requests in flight as soon as the plan stops
        being routable (a stage's peer declared dead by gossip): their tokens will not come,
        and a peer that vanished without a reset would otherwise hold them until the
        overlay's dead-peer timeout."""
        while True:
            await trio.sleep(_WATCH_INTERVAL)
            split = self.split
            if split is None or split.model is None or self.placement.routable:
                continue
            if split.pipeline is not None:
                split.pipeline.interrupt(
                    "the split lost a stage (its peer is gone or left the plan)"
                )

    async def _watch_certification(self) -> None:
        """A family the stage engine runs but the planner splits only once certified (hybrid
        and recurrent models): allow splits as soon as a capability record for this model
        file is known, certified here or heard from a peer."""
        if self.cost.split_refusal is None or not family_traits(self.layout).certifiable:
            return
        sha = await trio.to_thread.run_sync(lambda: self.store.source_sha256(self.model_path))
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
            await trio.sleep(_CERTIFICATION_INTERVAL)

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

    def _prefix_budget(self, plan: Plan) -> int:
        """Bytes of kept prefixes this agent's part may use: of what it offers, what the
        plan's part here leaves free (`config.prefix_budget`). A split's entry counts them
        for every stage, which keep what it tells them to up to what they have free: it
        keeps no more than `_STAGE_SHARE` of any stage's free bytes, as gossip shows them."""
        me = self.placement.gossip.snapshot().get(self.peer_id)
        offered = offered_memory(me.record) if me is not None else 0
        free = self._free_bytes(plan, self.peer_id) or 0
        budget = prefix_budget(self.settings.prefix_cache, offered, offered - free)
        if plan.split and plan.stages[0].peer_id == self.peer_id:
            for st in plan.stages[1:]:
                free = self._free_bytes(plan, st.peer_id)
                if free is not None:
                    budget = min(budget, int(free * _STAGE_SHARE))
        return budget

    def _free_bytes(self, plan: Plan, peer: str) -> int | None:
        """What `peer`'s part of `plan` leaves free of what it offers (None: its record is
        not known here). A later stage holds kept prefixes up to this (`kept_budget`)."""
        view = self.placement.gossip.snapshot().get(peer)
        if view is None:
            return None
        start, end = 0, self.cost.n_layers
        for st in plan.stages:
            if st.peer_id == peer:
                start, end = st.start, st.end
        spare = getattr(view.record, "mem_spare_bytes", 0)
        needed = self.cost.offer_bytes(start, end, plan.context_tokens, spare)
        return max(0, offered_memory(view.record) - needed)

    def in_plan(self, key: str) -> bool:
        """Whether artifact `key` is part of the split in force (a peer may have it cut here
        from the whole file: `transfer.ArtifactServer`)."""
        claim = self.placement.in_force
        return claim is not None and needed_by(claim.plan, key)

    # ----- the directory the API asks -----

    def local_models(self) -> list[LocalModel]:
        return [self._offered] if self._offered is not None else []

    def receipt(self, model: LocalModel) -> Headers:
        return list(self._receipt) if model is self._offered else []

    def unserved_for_now(self, name: str) -> float:
        if name.casefold() != self.info.id.casefold():
            return 0.0
        return self.settings.replay_deadline

    def why_unserved(self, name: str) -> str | None:
        p = self.placement
        if name.casefold() != self.info.id.casefold() or p.routable or p.error is None:
            return None
        held = trio.current_time() - p.error_since
        return p.error if held >= UNSERVED_SETTLE else None

    def remote_models(self) -> list[RemoteModel]:
        claim = self.placement.in_force
        if claim is None or not self.placement.routable:
            return []
        plan = claim.plan
        if plan.split:
            if self.local is not None:
                return []  # this agent is the entry
            entry = plan.stages[0].peer_id
            stages = tuple((s.peer_id, s.start, s.end) for s in plan.stages)
            return [
                RemoteModel(
                    self.info.id,
                    entry,
                    "split",
                    stages,
                    self.layout.n_layers,
                    self.settings.slot_ctx,
                )
            ]
        # Every other replica serving now, also when this agent is one: the API routes a
        # request to the replica that holds its conversation (`api/routing.py`).
        return [
            RemoteModel(
                self.info.id, peer, "whole", (), self.layout.n_layers, self.settings.slot_ctx
            )
            for peer in plan.replicas
            if peer != self.peer_id and peer in self.placement.ready
        ]

    async def open_stream(self, peer_id: str, label: str = FORWARD_LABEL) -> MeshStream:
        return await self.overlay.open_stream(peer_id, label)

    # ----- what the agent reports -----

    def layers(self) -> tuple[int, int]:
        """The layers of the model this agent runs: all of them unless it holds a stage."""
        if self.split is not None and self.split.part is not None:
            return self.split.part.start, self.split.part.end
        return 0, self.layout.n_layers

    def serving_record(self) -> tuple[Serving, ...]:
        """What this agent serves now, as its gossip record says: the whole model or its
        stage, once loaded; nothing otherwise."""
        if self.local is None and self.split is None:
            return ()
        a, b = self.layers()
        sha = self.placement.source_sha256  # the model file's, once measured
        return (Serving(self.info.id, sha, a, b, self.layout.n_layers),)

    def publish_serving(self) -> None:
        """Tell the mesh what this agent serves (`meshagent peers`' SERVES column)."""
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
                "error": self.placement.error,
            }
        plan = claim.plan
        return {
            "epoch": claim.epoch,
            "proposer": claim.proposer,
            "routable": self.placement.routable,
            "replicas": list(plan.replicas),
            "stages": [[s.peer_id, s.start, s.end] for s in plan.stages],
            "est_token_ms": round(plan.est_token_ms, 2),
            "wire_dtype": self.wire.dtype if plan.split and self.wire else None,
            "wire": self.wire.to_dict() if plan.split and self.wire else None,
            # peers of the plan that have not loaded their part yet (or are gone)
            "loading": [p for p in plan.peers if p not in self.placement.ready],
            "error": self.placement.error,
        }

    # ----- taking part in a plan -----

    async def _take_part(self, plan: Plan) -> None:
        assert self._nursery is not None
        s = self.settings
        if self.split is not None and self.split.keeps_part(plan):
            # The plan was repaired around a lost peer and this agent's part is unchanged:
            # nothing to load, and requests replayed on this entry find its runner.
            self.split.rewire(plan)
            if self.local is not None:  # the entry: within the new stages' room
                self.local.runner.rebudget(self._prefix_budget(plan))
            self._judge_windows(plan)
            if self.local is not None:
                self._offer(self.local, self._split_receipt(plan), plan)
            log.info("mesh_model.part", kept=True, stage=self.split.layers)
            return
        if self._keeps_replica(plan):
            # Replicas were added or dropped elsewhere: this one serves on as it was.
            assert self.local is not None
            self._offer(self.local, self._whole_receipt(), plan)
            log.info("mesh_model.part", kept=True, whole=True)
            return
        await self._unload()
        receipt: Headers = []
        if self.peer_id in plan.replicas:
            # A partial copy of a hub model is completed (and checked whole) first.
            await self.source.complete(self.info, self.placement.gossip)
            n, ctx = self.cost.n_layers, plan.context_tokens
            gpu = offloaded_layers(self.cost, 0, n, ctx, s.vram)
            engine = await trio.to_thread.run_sync(
                lambda: LlamaEngine(
                    self.model_path,
                    slots=s.slots,
                    slot_ctx=s.slot_ctx,
                    threads=s.threads,
                    gpu_layers=gpu,
                )
            )
            self._whole = engine
            self.local = LocalModel.whole(
                engine, max_queue=s.max_queue, prefix_budget=self._prefix_budget(plan)
            )
            self.local.speculation = s.speculation
            self.local.embedder = Embedder(str(self.model_path), threads=s.threads)
            receipt = self._whole_receipt()
        elif any(st.peer_id == self.peer_id for st in plan.stages):
            wire = self.wire = await self._wire_choice()
            host = SplitHost(
                peer_id=self.peer_id,
                model_path=self.model_path,
                layout=self.layout,
                info=self.info,
                store=self.store,
                open_stream=self._open_stream,
                obtain=self.source.obtain,
                settings=SplitSettings(
                    slots=s.slots,
                    slot_ctx=s.slot_ctx,
                    threads=s.threads,
                    max_queue=s.max_queue,
                    wire_dtype=wire.dtype,
                    prefix_budget=self._prefix_budget(plan),
                    vram=s.vram,
                    kept_budget=self._free_bytes(plan, self.peer_id) or 0,
                ),
            )
            await host.load(plan)
            self.split = host
            self.local = host.model
            if self.local is not None:  # the entry: requests survive a lost stage
                self.local.reroute = self._reroute
                self.local.replay_deadline = s.replay_deadline
                self.local.speculation = s.speculation
                self._judge_windows(plan)
            receipt = self._split_receipt(plan)
        if self.local is not None:
            scope = trio.CancelScope()
            self._serving_scope = scope
            local = self.local
            served = self._served = trio.Event()

            async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
                try:
                    with scope:
                        await local.run(task_status=task_status)
                finally:
                    served.set()

            await self._nursery.start(serve)
            self._offer(local, receipt, plan)
        self.publish_serving()
        log.info(
            "mesh_model.part",
            whole=self._whole is not None,
            stage=None if self.split is None else (self.split.part.start, self.split.part.end),
            entry=self.local is not None,
        )

    def _judge_windows(self, plan: Plan) -> None:
        """A split's drafts change no token only where every stage computes a window as it
        computes one-token steps. The entry judges its own build; each other stage's agent
        says in gossip whether its build does (`windows_inexact`)."""
        pipeline = self.split.pipeline if self.split is not None else None
        if pipeline is None:
            return
        pipeline.exact_windows = pipeline.entry.exact_windows
        pipeline.windows_reason = pipeline.entry.windows_reason
        views = self.placement.gossip.snapshot()
        for st in plan.stages:
            view = views.get(st.peer_id)
            if st.peer_id != self.peer_id and view is not None and view.record.windows_inexact:
                pipeline.exact_windows = False
                who = view.record.name or st.peer_id[:12]
                pipeline.windows_reason = (
                    f"a split: the stage on {who} computes windows otherwise: "
                    f"{view.record.windows_inexact}"
                )
                return

    def _whole_receipt(self) -> Headers:
        return [(b"x-meshagent-stages", f"{self.peer_id}:0-{self.layout.n_layers}".encode())]

    def _split_receipt(self, plan: Plan) -> Headers:
        assert self.wire is not None
        stages = ",".join(f"{st.peer_id}:{st.start}-{st.end}" for st in plan.stages)
        return [
            (b"x-meshagent-stages", stages.encode()),
            (b"x-meshagent-wire-dtype", self.wire.dtype.encode()),
            (b"x-meshagent-wire-exact", b"certified" if self.wire.certified_exact else b"no"),
        ]

    def _offer(self, local: LocalModel, receipt: Headers, plan: Plan) -> None:
        if self._offered_plan is not None and self._offered_plan != plan:
            self._replaced = (self._offered_plan, trio.current_time())
        self._offered, self._receipt, self._offered_plan = local, receipt, plan
        self._offers.set()
        self._offers = trio.Event()

    def _withdraw(self) -> None:
        """Offer nothing here until a part serves again (requests go elsewhere or wait)."""
        self._offered, self._receipt = None, []

    async def _release(self, plan: Plan) -> None:
        """The plan this agent serves is no longer in force; `plan` replaces it. When this
        agent keeps its part of a split there (a repair around a lost peer), its engines stay
        loaded: the chain in flight is interrupted (its requests replay once the new chain
        serves) and nothing is offered until then. Otherwise everything is unloaded."""
        if self._keeps_replica(plan):
            return  # it serves on: requests in flight here finish here
        if self.split is None or not self.split.keeps_part(plan):
            await self._unload()
            return
        self._withdraw()
        if self.split.pipeline is not None:
            self.split.pipeline.rechain("the mesh is replacing a lost stage")

    def _keeps_replica(self, plan: Plan) -> bool:
        """This agent serves the model whole and `plan` keeps it as a replica."""
        return self._whole is not None and self.local is not None and self.peer_id in plan.replicas

    async def _reroute(self) -> Route:
        """For a request whose split lost a stage: the runner that serves the model here now,
        waiting while there is none or the plan in force is not routable (a request tried on
        a chain that is not back would only fail again). The same plan keeps its runner (the
        pipeline opens its chain again on the next step); a new plan that keeps this agent
        the entry (or makes it a replica) brings a new one. The request bounds the wait
        (`replay_deadline`). The route names the stages found lost meanwhile."""
        lost: set[str] = set()
        while True:
            lost |= self._lost_stages()
            local = self._offered
            if local is not None and local.runner.aborted is None and self.placement.routable:
                return Route(local.runner, local.engine.token_bytes, tuple(sorted(lost)))
            if self._served_elsewhere():
                raise ModelMoved("the mesh moved this model: another agent serves it now; retry")
            with trio.move_on_after(_REROUTE_POLL):
                await self._offers.wait()

    def _lost_stages(self) -> set[str]:
        """The stages of the plan served here, and of the one it replaced lately (a request
        may have broken on that one), whose peers gossip has declared dead (or forgotten)."""
        plans = [self._offered_plan]
        if self._replaced is not None:
            plan, until = self._replaced
            if trio.current_time() - until < self.settings.replay_deadline:
                plans.append(plan)
        views = self.placement.gossip.snapshot()  # alive and suspect peers only
        lost: dict[str, str] = {}  # peer -> its stage, in the newest plan that has it
        for p in plans:
            for st in p.stages if p is not None and p.split else ():
                v = views.get(st.peer_id)
                if (v is None or v.state == PeerState.DEAD) and st.peer_id not in lost:
                    lost[st.peer_id] = _stage(st)
        return set(lost.values())

    def _served_elsewhere(self) -> bool:
        """A routable plan is in force and requests enter it at other agents only."""
        claim = self.placement.in_force
        if not self.placement.routable or claim is None:
            return False
        plan = claim.plan
        entries = plan.replicas if not plan.split else (plan.stages[0].peer_id,)
        return self.peer_id not in entries

    async def _open_stream(self, peer_id: str, label: str, **window: int) -> MeshStream:
        """A stream of the split to `peer_id`; a peer this agent lost its connection to (it
        crashed and came back, say) is dialled at once rather than on the dialer's backoff."""
        try:
            return await self.overlay.open_stream(peer_id, label, **window)
        except ConnectionUnavailable:
            if self._reach is None:
                raise
            await self._reach(peer_id)
            return await self.overlay.open_stream(peer_id, label, **window)

    async def _wire_choice(self) -> WireChoice:
        """The dtype this agent sends activations in (the entry's choice holds for the chain)."""
        sha = await trio.to_thread.run_sync(lambda: self.store.source_sha256(self.model_path))
        signed = self.capabilities.for_model(sha)  # reads gossip: on the event loop
        if signed is None and self.layout.split_refusal is not None:
            # A split of a family split only once certified: a peer holds the record, and
            # gossip brings it here shortly (the plan may have arrived first).
            with trio.move_on_after(_RECORD_WAIT):
                while signed is None:
                    await trio.sleep(0.2)
                    signed = self.capabilities.for_model(sha)
        choice = choose_wire_dtype(self.settings.wire_dtype, signed and signed.record)
        log.info("mesh_model.wire", **choice.to_dict())
        return choice

    async def _unload(self) -> None:
        """Stop serving the previous part: requests waiting on it fail with a clear error, and
        engines are freed only once no computation uses them."""
        self._withdraw()
        self.wire = None
        if self.local is not None:
            # Temporary for a split (503 with Retry-After): the mesh is moving it.
            moved = "the mesh moved this model to a new placement; retry"
            self.local.runner.abort(ModelMoved(moved) if self.split else EngineError(moved))
        if self._serving_scope is not None:
            self._serving_scope.cancel()
            self._serving_scope = None
            await self._served.wait()
        if self.local is not None and self.local.embedder is not None:
            await self.local.embedder.aclose()
        if self._whole is not None:
            self._whole.close()
            self._whole = None
        if self.split is not None:
            # A stage's stream may be computing on its worker thread right now: freeing the
            # engine under it crashed the agent (a segfault in llama.cpp) when a plan moved.
            await self.split.aclose()
            self.split = None
        self.local = None
        self.publish_serving()

    async def aclose(self) -> None:
        await self._unload()


def _stage(stage: Any) -> str:
    """A stage as receipts name it: `<peer id>:<first layer>-<end>`."""
    return f"{stage.peer_id}:{stage.start}-{stage.end}"
