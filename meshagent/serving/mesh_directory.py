"""The model directory of an agent in the mesh (`serving/directory.py`): what it offers of its
model now, and which peers serve the model when it does not.

What is offered here changes as placement moves the model (`serving/parts.py` offers a part
once its runner runs, and withdraws it when the plan moves on); the directory keeps the plan
that part serves, and the one it replaced lately (a request may have broken on that one), for
recovery (`serving/recovery.py`), which also waits on its changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from meshagent.engine.base import ModelInfo
from meshagent.models.layout import ModelLayout
from meshagent.net.stream import MeshStream
from meshagent.placement.planner import Plan
from meshagent.placement.service import PlacementService
from meshagent.serving.directory import GENERATE_LABEL, Headers, RemoteModel
from meshagent.serving.local_model import LocalModel
from meshagent.serving.settings import ServingSettings

# Seconds a reason for not serving must hold before it is said (the startup line, the API):
# while an agent starts, its own memory is not yet counted and the mesh looks empty.
UNSERVED_SETTLE = 3.0


@dataclass(eq=False)
class MeshDirectory:
    peer_id: str
    info: ModelInfo
    layout: ModelLayout
    placement: PlacementService
    overlay: Any
    settings: ServingSettings

    def __post_init__(self) -> None:
        self.model: LocalModel | None = None  # offered here: its runner runs
        self._receipt: Headers = []
        self._offers = trio.Event()  # set (and replaced) whenever the offer changes
        self._plan: Plan | None = None  # the plan `model` serves (or last served)
        self._replaced: tuple[Plan, float] | None = None  # the plan before it, and until when

    # ----- the offer -----

    def offer(self, model: LocalModel, receipt: Headers, plan: Plan) -> None:
        """`model` serves `plan` here from now on; requests get `receipt`."""
        if self._plan is not None and self._plan != plan:
            self._replaced = (self._plan, trio.current_time())
        self.model, self._receipt, self._plan = model, receipt, plan
        self._changed()

    def withdraw(self) -> None:
        """Offer nothing here until a part serves again (requests go elsewhere or wait)."""
        self.model, self._receipt = None, []
        self._changed()

    def _changed(self) -> None:
        self._offers.set()
        self._offers = trio.Event()

    @property
    def plans(self) -> list[Plan]:
        """The plan served here (or last served), and the one it replaced if that was
        within a replay's deadline."""
        plans = [] if self._plan is None else [self._plan]
        if self._replaced is not None:
            plan, until = self._replaced
            if trio.current_time() - until < self.settings.replay_deadline:
                plans.append(plan)
        return plans

    async def changed(self) -> None:
        """Until the offer here changes, or placement decides again (a plan, a peer's
        state in gossip)."""
        offers, decided = self._offers, self.placement.changed
        async with trio.open_nursery() as nursery:

            async def wake(event: trio.Event) -> None:
                await event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(wake, offers)
            nursery.start_soon(wake, decided)

    # ----- what the API asks (`ModelDirectory`) -----

    def local_models(self) -> list[LocalModel]:
        return [self.model] if self.model is not None else []

    def receipt(self, model: LocalModel) -> Headers:
        return list(self._receipt) if model is self.model else []

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

    def _name(self, peer_id: str) -> str:
        """The name `peer_id` goes by, as its record gives it ("" when not known)."""
        view = self.placement.gossip.snapshot().get(peer_id)
        return view.record.name if view is not None and view.record is not None else ""

    def remote_models(self) -> list[RemoteModel]:
        claim = self.placement.in_force
        if claim is None or not self.placement.routable:
            return []
        plan = claim.plan
        n, ctx = self.layout.n_layers, self.settings.slot_ctx
        if plan.split:
            # Each chain serving now whose entry is another agent (the one this agent is the
            # entry of serves here): the API spreads requests over them (`api/routing.py`).
            ready = set(self.placement.ready)
            out = []
            for chain in plan.pipelines:
                entry = chain[0].peer_id
                if entry == self.peer_id or not all(s.peer_id in ready for s in chain):
                    continue
                stages = tuple((s.peer_id, s.start, s.end) for s in chain)
                out.append(
                    RemoteModel(self.info.id, entry, "split", stages, n, ctx, self._name(entry))
                )
            return out
        # Every other replica serving now, also when this agent is one: the API routes a
        # request to the replica that holds its conversation (`api/routing.py`).
        return [
            RemoteModel(self.info.id, peer, "whole", (), n, ctx, self._name(peer))
            for peer in plan.replicas
            if peer != self.peer_id and peer in self.placement.ready
        ]

    async def open_stream(self, peer_id: str, label: str = GENERATE_LABEL) -> MeshStream:
        return await self.overlay.open_stream(peer_id, label)
