"""This agent's part of a split plan: load its stage, wire its streams, serve.

`SplitHost.load(plan)` gets the artifacts (cut from the full model if this agent has it,
else fetched from a peer that holds them), loads the stage engine off the event loop, and
then serves: the entry stage as a `LocalModel` whose runner executes with a `PipelineExecutor`, the
other stages as `StageServer`s for inbound `stage/1` streams.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from meshagent.engine.llama import LlamaEngine
from meshagent.engine.stage import StageEngine
from meshagent.errors import EngineError
from meshagent.net.stream import MeshStream
from meshagent.placement.planner import ModelCost, Plan, StageAssignment, offloaded_layers
from meshagent.serving.draft_loading import load_draft
from meshagent.serving.local_model import LocalModel
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.pipeline import (
    ACTIVATION_WINDOW_BYTES,
    ACTIVATION_WINDOW_FRAMES,
    REPLY_LABEL,
    STAGE_LABEL,
    EntryEngine,
    PipelineExecutor,
)
from meshagent.serving.runner import ModelRunner
from meshagent.serving.settings import ServingSettings
from meshagent.serving.stage_server import StageServer

log = structlog.get_logger(__name__)

OpenStream = Callable[..., Awaitable[MeshStream]]
Obtain = Callable[[str, int, int], Awaitable[None]]


@dataclass(frozen=True)
class PartBudgets:
    """What a part of a split may use, as its plan leaves it room (`serving/parts.py`)."""

    wire_dtype: str = "f32"  # what the entry sends (the stages after it send on the same)
    # Bytes of kept prefixes the entry may count on, in the biggest stage's KV (every stage
    # keeps its own KV of each; see PipelineExecutor).
    prefix_budget: int = 0
    # Bytes of kept prefixes a later stage holds at most, whatever its upstream asks: what
    # the plan leaves free of this agent's offer (the entry keeps within every stage's).
    kept_budget: int = 0


# Reply streams the entry reads at once from the last stage: the one of the chain in force,
# and one that an older chain's last stage has not closed yet. A newer one resets the oldest.
MAX_REPLY_STREAMS = 2


class SplitHost:
    def __init__(
        self,
        *,
        peer_id: str,
        files: ModelFiles,
        open_stream: OpenStream,
        settings: ServingSettings,
        budgets: PartBudgets,
        obtain: Obtain | None = None,
        find_draft: Callable[[], Awaitable[Path | None]] | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.files = files
        self._open_stream = open_stream  # (peer_id, label, **window) -> stream
        # (kind, start, end): have the store hold that artifact (`serving/obtain.py`); None:
        # the store cuts it from the whole file when asked.
        self._obtain_artifact = obtain
        self._find_draft = find_draft  # `--draft-model auto`: a catalogued model's file
        self.settings = settings
        self.budgets = budgets
        self.plan: Plan | None = None
        self.part: StageAssignment | None = None
        self.model: LocalModel | None = None  # set on the entry
        self.pipeline: PipelineExecutor | None = None  # set on the entry
        self.server: StageServer | None = None  # set on other stages
        self._engine: StageEngine | None = None
        self._entry: EntryEngine | None = None
        self._draft: LlamaEngine | None = None  # the entry's draft model (`--draft-model`)
        # The plan's peers this agent's streams go to or come from: the next stage (None:
        # this is the last), the previous one (None: this is the entry), the entry (where the
        # last stage replies) and the last stage (whose replies the entry takes).
        self._next: str | None = None
        self._previous: str | None = None
        self._entry_peer = ""
        self._last_peer = ""
        self._replies: list[MeshStream] = []  # reply streams the entry reads now, oldest first

    async def _obtain(self, kind: str, start: int, end: int) -> None:
        if self._obtain_artifact is not None:
            await self._obtain_artifact(kind, start, end)

    @property
    def layers(self) -> tuple[int, int] | None:
        return None if self.part is None else (self.part.start, self.part.end)

    @property
    def is_entry(self) -> bool:
        return self.part is not None and self.part.start == 0

    def _wire(self, plan: Plan) -> None:
        """Take this agent's neighbours in `plan`: where its streams go, whence they may come."""
        order = [s.peer_id for s in plan.stages]
        i = order.index(self.peer_id)
        self._next = order[i + 1] if i + 1 < len(order) else None
        self._previous = order[i - 1] if i > 0 else None
        self._entry_peer, self._last_peer = order[0], order[-1]

    def keeps_part(self, plan: Plan) -> bool:
        """Whether `plan` gives this agent the part it has loaded, in a chain as long (only
        its neighbours may differ): then `rewire` serves it without loading anything."""
        mine = next((s for s in plan.stages if s.peer_id == self.peer_id), None)
        return (
            self.plan is not None
            and self.part is not None
            and mine is not None
            and (mine.start, mine.end) == (self.part.start, self.part.end)
            and len(plan.stages) == len(self.plan.stages)
            and plan.context_tokens == self.plan.context_tokens
        )

    def rewire(self, plan: Plan) -> None:
        """Serve the same part in `plan` (see `keeps_part`): streams go to its neighbours
        from the next one opened on."""
        if not self.keeps_part(plan):
            raise EngineError(f"peer {self.peer_id} has another part in this plan")
        self.plan = plan
        self._wire(plan)
        log.info(
            "split.rewired",
            layers=(self.part.start, self.part.end),
            next=self._next,
            previous=self._previous,
        )

    async def load(self, plan: Plan) -> None:
        """Load this agent's stage of `plan` (blocking work off the event loop)."""
        part = next((s for s in plan.stages if s.peer_id == self.peer_id), None)
        if part is None:
            raise EngineError(f"peer {self.peer_id} has no part in this plan")
        s, b, f = self.settings, self.budgets, self.files
        await self._obtain("layers", part.start, part.end)
        layers_path, _ = await trio.to_thread.run_sync(
            lambda: f.store.ensure_layers(f.path, part.start, part.end, f.layout)
        )
        cost = ModelCost.from_layout(self.files.info.id, self.files.layout)
        gpu = offloaded_layers(cost, part.start, part.end, plan.context_tokens, s.vram)
        engine = await trio.to_thread.run_sync(
            lambda: StageEngine(
                layers_path,
                start=part.start,
                end=part.end,
                total_layers=self.files.layout.n_layers,
                slots=s.slots,
                slot_ctx=s.slot_ctx,
                threads=s.threads,
                flash_attn=s.flash_attn,
                gpu_layers=gpu,
            )
        )
        self.plan, self.part, self._engine = plan, part, engine
        self._wire(plan)
        nxt = self._next
        window = {
            "window_bytes": ACTIVATION_WINDOW_BYTES,
            "window_frames": ACTIVATION_WINDOW_FRAMES,
        }
        if part.start == 0:
            await self._obtain("entry", 0, 0)
            entry_path, _ = await trio.to_thread.run_sync(
                lambda: self.files.store.ensure_entry(self.files.path, self.files.layout)
            )
            self._entry = await trio.to_thread.run_sync(
                lambda: EntryEngine(entry_path, engine, f.info, f.layout.weight_types)
            )
            assert nxt is not None
            biggest = max(st.end - st.start for st in plan.stages)
            self.pipeline = PipelineExecutor(
                self._entry,
                lambda: self._open_stream(self._next, STAGE_LABEL, **window),
                wire_dtype=b.wire_dtype,
                depth=len(plan.stages),
                prefix_budget=b.prefix_budget,
                prefix_scale=biggest / (part.end - part.start),
                work_scale=plan.stages[-1].end / (part.end - part.start),
            )
            runner = ModelRunner(
                self.pipeline,
                max_queue=s.max_queue,
                is_end=self._entry.is_end_of_generation,
                token_bytes=self._entry.token_bytes,
            )
            self.model = LocalModel(self._entry, runner)
            if s.draft_model:  # the draft model runs where requests enter
                self._draft, draft = await load_draft(
                    s, self._entry, f.info.size_bytes, find=self._find_draft
                )
                runner.scheduler.drafting.model = draft
        elif nxt is not None:
            self.server = StageServer(
                engine,
                n_vocab=self.files.info.n_vocab,
                kept_budget=b.kept_budget,
                open_next=lambda: self._open_stream(self._next, STAGE_LABEL, **window),
                open_reply=None,
            )
        else:
            self.server = StageServer(
                engine,
                n_vocab=self.files.info.n_vocab,
                kept_budget=b.kept_budget,
                open_next=None,
                open_reply=lambda: self._open_stream(self._entry_peer, REPLY_LABEL),
            )
        log.info("split.loaded", layers=(part.start, part.end), entry=self.is_entry, next=nxt)

    async def handle_stage(self, stream: MeshStream) -> None:
        """Serve a `stage/1` stream from the previous stage of the plan (a new one replaces
        the one served before it); from any other peer, refuse it and disturb nothing."""
        if self.server is None:
            stream.reset("this agent runs no middle or last stage")
            return
        if stream.peer_id != self._previous:
            self._refuse(stream, "the previous stage", self._previous)
            return
        await self.server.handle(stream)

    async def handle_reply(self, stream: MeshStream) -> None:
        """Take tokens on a `stage-reply/1` stream from the plan's last stage only."""
        if self.model is None:
            stream.reset("this agent is not the entry of a split")
            return
        if stream.peer_id != self._last_peer:
            self._refuse(stream, "the last stage", self._last_peer)
            return
        assert self.pipeline is not None
        if len(self._replies) >= MAX_REPLY_STREAMS:
            oldest = self._replies.pop(0)
            oldest.reset("a newer reply stream from the last stage replaced this one")
        self._replies.append(stream)
        try:
            await self.pipeline.handle_reply(stream)
        finally:
            if stream in self._replies:
                self._replies.remove(stream)

    def _refuse(self, stream: MeshStream, role: str, allowed: str | None) -> None:
        why = (
            f"{stream.label} streams come from {role} of the split's plan ({allowed}), "
            f"not from {stream.peer_id}"
        )
        log.warning(
            "split.stream_refused",
            label=stream.label,
            peer=stream.peer_id,
            allowed=allowed,
            layers=self.layers,
        )
        stream.reset(why)

    async def end_idle_streams(self) -> None:
        """The agent is leaving: the entry ends its stream down, a stage the stream it serves
        (and with it those it sends on), once nothing is in flight on it."""
        if self.server is not None:
            await self.server.end_when_idle()
        elif self.pipeline is not None:
            await self.pipeline.chain.end_when_idle()

    async def aclose(self) -> None:
        """Free the engines once nothing computes with them: a middle or last stage first
        ends the stream it serves (a forward running on its worker thread finishes). The
        entry's runner must be stopped by its owner before."""
        if self.server is not None:
            await self.server.aclose()
        self.close()

    def close(self) -> None:
        if self._draft is not None:
            self._draft.close()
            self._draft = None
        if self._entry is not None:
            self._entry.close()
        elif self._engine is not None:
            self._engine.close()
