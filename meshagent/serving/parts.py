"""This agent's part of the plan in force: load it, serve it, let it go.

Placement calls `take` with each plan this agent has a part in, and `release` when the plan
it serves is replaced. The part is the whole model (a replica: `LocalModel.whole`) or a stage
of a split (`SplitHost`; the entry also serves requests, through a `PipelineExecutor`). A
repair around a lost peer that leaves this agent's part as it is loads nothing: the split is
rewired to its new neighbours, and the entry's requests replay on the new chain
(`serving/recovery.py`). Once its runner runs, a part is offered in the model directory.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import structlog
import trio

from meshagent.capacity import offered_memory
from meshagent.config import prefix_budget
from meshagent.engine.llama import LlamaEngine
from meshagent.errors import EngineError, ModelMoved
from meshagent.models.capability import WireChoice
from meshagent.net.stream import MeshStream
from meshagent.placement.planner import Plan, offloaded_layers
from meshagent.placement.service import PlacementService
from meshagent.serving.capabilities import Capabilities
from meshagent.serving.draft_loading import FindDraft, load_draft
from meshagent.serving.embeddings import Embedder
from meshagent.serving.local_model import LocalModel
from meshagent.serving.mesh_directory import MeshDirectory
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.obtain import ArtifactSource
from meshagent.serving.receipts import split_receipt, whole_receipt
from meshagent.serving.recovery import Rerouting
from meshagent.serving.settings import ServingSettings
from meshagent.serving.split_host import PartBudgets, SplitHost
from meshagent.serving.wire_choice import choose_wire, judge_windows

log = structlog.get_logger(__name__)

# A split's entry keeps prefixes within this share of each stage's free bytes: its size of a
# prefix is an estimate, and a stage refuses past what it has free (`kept_budget`).
_STAGE_SHARE = 0.75
_DRAIN_LOOK = 0.1  # seconds between looks at whether a part's last request has ended

OpenStream = Callable[..., Awaitable[MeshStream]]


class Parts:
    def __init__(
        self,
        *,
        peer_id: str,
        files: ModelFiles,
        source: ArtifactSource,
        placement: PlacementService,
        capabilities: Capabilities,
        directory: MeshDirectory,
        rerouting: Rerouting,
        settings: ServingSettings,
        open_stream: OpenStream,
        published: Callable[[], None],
        find_draft: FindDraft | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.files = files
        self.source = source
        self.placement = placement
        self.capabilities = capabilities
        self.directory = directory
        self.rerouting = rerouting
        self.settings = settings
        self._open_stream = open_stream
        self._published = published  # tell the mesh what this agent serves now
        self._find_draft = find_draft  # `--draft-model auto`: a catalogued model's file
        self.local: LocalModel | None = None  # what this agent serves, whole or as entry
        self.split: SplitHost | None = None
        self.wire: WireChoice | None = None  # the split's wire dtype, when in one
        self._whole: LlamaEngine | None = None
        self._draft: LlamaEngine | None = None  # the draft model's engine (`--draft-model`)
        self._nursery: trio.Nursery | None = None
        self._serving_scope: trio.CancelScope | None = None
        self._served = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Where the runners of the parts loaded run, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    @property
    def whole(self) -> bool:
        return self._whole is not None

    def layers(self) -> tuple[int, int]:
        """The layers of the model this agent runs: all of them unless it holds a stage."""
        if self.split is not None and self.split.part is not None:
            return self.split.part.start, self.split.part.end
        return 0, self.files.layout.n_layers

    # ----- placement's calls -----

    async def take(self, plan: Plan) -> None:
        """Serve this agent's part of `plan`: the one loaded, where `plan` keeps it, else a
        new one."""
        if self.split is not None and self.split.keeps_part(plan):
            # The plan was repaired around a lost peer and this agent's part is unchanged:
            # nothing to load, and requests replayed on this entry find its runner.
            self.split.rewire(plan)
            if self.local is not None:  # the entry: within the new stages' room
                self.local.runner.rebudget(self.prefix_budget(plan))
                self._judge_windows(plan)
                self.directory.offer(self.local, self._split_receipt(plan), plan)
            log.info("mesh_model.part", kept=True, stage=self.split.layers)
            return
        if self._keeps_replica(plan):
            # Replicas were added or dropped elsewhere: this one serves on as it was.
            assert self.local is not None
            self.directory.offer(self.local, self._whole_receipt(), plan)
            log.info("mesh_model.part", kept=True, whole=True)
            return
        await self.unload()
        began = time.monotonic()
        if self.peer_id in plan.replicas:
            await self._load_whole(plan)
            receipt = self._whole_receipt()
        elif any(st.peer_id == self.peer_id for st in plan.stages):
            await self._load_stage(plan)
            receipt = self._split_receipt(plan)
        if self.local is not None:
            await self._serve(self.local, receipt, plan)
        self._published()
        log.info(
            "mesh_model.part",
            whole=self._whole is not None,
            stage=None if self.split is None else self.split.layers,
            entry=self.local is not None,
            load_s=round(time.monotonic() - began, 2),
        )

    async def release(self, plan: Plan) -> None:
        """The plan this agent serves is no longer in force; `plan` replaces it. When this
        agent keeps its part of a split there (a repair around a lost peer), its engines stay
        loaded: the chain in flight is interrupted (its requests replay once the new chain
        serves) and nothing is offered until then. Otherwise everything is unloaded. A plan
        of no peers (the mesh placed the model nowhere: its memory went to another model, or
        no one asked for it within keep_alive) first lets the requests here finish."""
        if not plan.peers:
            await self._drain()
            await self.unload()
            return
        if self._keeps_replica(plan):
            return  # it serves on: requests in flight here finish here
        if self.split is None or not self.split.keeps_part(plan):
            await self.unload()
            return
        self.directory.withdraw()
        if self.split.pipeline is not None:
            self.split.pipeline.rechain("the mesh is replacing a lost stage")

    async def _drain(self) -> None:
        """Offer nothing new here, and wait (up to the grace) until no request is in flight
        on this agent's part."""
        self.directory.withdraw()
        local = self.local
        if local is None:
            return
        local.runner.close()
        with trio.move_on_after(self.settings.grace):
            while (stats := local.runner.stats()).active or stats.queued:
                await trio.sleep(_DRAIN_LOOK)

    def _keeps_replica(self, plan: Plan) -> bool:
        """This agent serves the model whole and `plan` keeps it as a replica."""
        return self._whole is not None and self.local is not None and self.peer_id in plan.replicas

    # ----- loading -----

    async def _load_whole(self, plan: Plan) -> None:
        s = self.settings
        # A partial copy of a hub model is completed (and checked whole) first.
        await self.source.complete(self.files.info, self.placement.gossip)
        n, ctx = self.placement.cost.n_layers, plan.context_tokens
        gpu = offloaded_layers(self.placement.cost, 0, n, ctx, s.vram)
        engine = await trio.to_thread.run_sync(
            lambda: LlamaEngine(
                self.files.path,
                slots=s.slots,
                slot_ctx=s.slot_ctx,
                threads=s.threads,
                gpu_layers=gpu,
            )
        )
        self._whole = engine
        draft = None
        if s.draft_model:
            self._draft, draft = await load_draft(
                s, engine, engine.info.size_bytes, find=self._draft_finder()
            )
        budget = self.prefix_budget(plan)
        self.local = LocalModel.whole(
            engine, max_queue=s.max_queue, prefix_budget=budget, draft=draft
        )
        self.local.speculation = s.speculation
        self.local.embedder = Embedder(str(self.files.path), threads=s.threads)

    def _draft_finder(self) -> Callable[[], Awaitable[Path | None]] | None:
        """`--draft-model auto`'s look for a catalogued draft model for this one."""
        return None if self._find_draft is None else partial(self._find_draft, self.files)

    async def _load_stage(self, plan: Plan) -> None:
        s = self.settings
        wire = self.wire = await choose_wire(
            s.wire_dtype,
            store=self.files.store,
            model_path=self.files.path,
            layout=self.files.layout,
            capabilities=self.capabilities,
            changed=lambda: self.placement.changed.wait(),
        )
        host = SplitHost(
            peer_id=self.peer_id,
            files=self.files,
            open_stream=self._open_stream,
            obtain=self.source.obtain,
            find_draft=self._draft_finder(),
            settings=s,
            budgets=PartBudgets(
                wire_dtype=wire.dtype,
                prefix_budget=self.prefix_budget(plan),
                kept_budget=self.free_bytes(plan, self.peer_id) or 0,
            ),
        )
        await host.load(plan)
        self.split = host
        self.local = host.model
        if host.server is not None:  # a later stage: its chain is served in this nursery
            assert self._nursery is not None
            await self._nursery.start(host.server.run)
        if self.local is not None:  # the entry: requests survive a lost stage
            self.local.routes = self.rerouting
            self.local.replay_deadline = s.replay_deadline
            self.local.speculation = s.speculation
            self._judge_windows(plan)

    async def _serve(self, local: LocalModel, receipt: list[tuple[bytes, bytes]], plan: Plan):
        """Run `local`'s runner, then offer it."""
        assert self._nursery is not None
        scope = self._serving_scope = trio.CancelScope()
        served = self._served = trio.Event()

        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
            try:
                with scope:
                    await local.run(task_status=task_status)
            finally:
                served.set()

        await self._nursery.start(serve)
        self.directory.offer(local, receipt, plan)

    def _judge_windows(self, plan: Plan) -> None:
        if self.split is not None and self.split.pipeline is not None:
            views = self.placement.gossip.snapshot()
            judge_windows(self.split.pipeline, plan, views, self.peer_id)

    def _whole_receipt(self) -> list[tuple[bytes, bytes]]:
        return whole_receipt(self.peer_id, self.files.layout.n_layers)

    def _split_receipt(self, plan: Plan) -> list[tuple[bytes, bytes]]:
        assert self.wire is not None
        return split_receipt(plan, self.wire)

    async def unload(self) -> None:
        """Stop serving the part: requests waiting on it fail with a clear error, and engines
        are freed only once no computation uses them."""
        self.directory.withdraw()
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
        if self._draft is not None:
            self._draft.close()
            self._draft = None
        if self.split is not None:
            # A stage's stream may be computing on its worker thread right now: freeing the
            # engine under it crashed the agent (a segfault in llama.cpp) when a plan moved.
            await self.split.aclose()
            self.split = None
        self.local = None
        self._published()

    # ----- the memory a part leaves for kept prefixes -----

    def prefix_budget(self, plan: Plan) -> int:
        """Bytes of kept prefixes this agent's part may use: of what it offers, what the
        plan's part here leaves free (`config.prefix_budget`). A split's entry counts them
        for every stage, which keep what it tells them to up to what they have free: it
        keeps no more than `_STAGE_SHARE` of any stage's free bytes, as gossip shows them."""
        me = self.placement.gossip.snapshot().get(self.peer_id)
        offered = offered_memory(me.record) if me is not None else 0
        free = self.free_bytes(plan, self.peer_id) or 0
        budget = prefix_budget(self.settings.prefix_cache, offered, offered - free)
        if plan.split and plan.stages[0].peer_id == self.peer_id:
            for st in plan.stages[1:]:
                free = self.free_bytes(plan, st.peer_id)
                if free is not None:
                    budget = min(budget, int(free * _STAGE_SHARE))
        return budget

    def free_bytes(self, plan: Plan, peer: str) -> int | None:
        """What `peer`'s part of `plan` leaves free of what it offers (None: its record is
        not known here). A later stage holds kept prefixes up to this (`kept_budget`)."""
        view = self.placement.gossip.snapshot().get(peer)
        if view is None:
            return None
        cost = self.placement.cost
        start, end = 0, cost.n_layers
        for st in plan.stages:
            if st.peer_id == peer:
                start, end = st.start, st.end
        spare = getattr(view.record, "mem_spare_bytes", 0)
        needed = cost.offer_bytes(start, end, plan.context_tokens, spare)
        return max(0, offered_memory(view.record) - needed)
