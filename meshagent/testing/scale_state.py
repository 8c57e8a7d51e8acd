"""The state the scale simulation (`scale_sim.py`) keeps: each model's plan in force on a side
of a cut, each agent's parts, the requests, and the tally of what happened."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshagent.placement.negotiation import plan_digest
from meshagent.placement.planner import ModelCost, Plan


@dataclass
class Force:
    """A model's plan in force on one side: its claim's epoch and proposer, since when."""

    plan: Plan
    epoch: int
    proposer: str
    since: float
    repair: bool = False

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.epoch, self.proposer, plan_digest(self.plan))


@dataclass
class Part:
    """A peer's part of a model: its layers, and when it is loaded."""

    start: int
    end: int
    ready_at: float


@dataclass
class Request:
    rid: int
    model: str
    entry: str
    arrived: float
    prompt: int
    output: int
    done: float = 0.0  # tokens decoded (fractional between ticks)
    tokens: list[int] = field(default_factory=list)  # those decoded, on the fake chains
    chain: tuple | None = None  # the chain it runs on: its stages as (peer, start, end)
    busy_until: float = 0.0  # prefilling until then
    lost_at: float | None = None
    no_chain_since: float | None = None  # waiting with no routable chain since then
    replays: int = 0
    waited_s: float = 0.0  # waiting for a chain after a loss, in all
    finished: float | None = None
    failed: str = ""


@dataclass
class Tally:
    formed_s: float = math.inf  # every model routable, after the mesh started
    views_full_s: float = math.inf
    events: list[dict] = field(default_factory=list)
    proposals: int = 0
    cut_off: int = 0  # decisions skipped: the view saw fewer agents than it lost lately
    assignments: int = 0  # distinct views planned
    assign_s: list[float] = field(default_factory=list)
    order_checks: int = 0  # views planned again with their peers in a shuffled order
    disagreements: int = 0  # of which gave another assignment
    record_bytes: list[int] = field(default_factory=list)  # of each record republished
    chains_most: dict[str, int] = field(default_factory=dict)  # most chains a model had at once

    @property
    def republished(self) -> int:
        return len(self.record_bytes)


# A chain as the simulation keys it: its stages as (peer, start, end), in order.
Chain = tuple[tuple[str, int, int], ...]


def plan_chains(plan: Plan, model: ModelCost) -> list[Chain]:
    """A split's chains, or each replica of a model served whole as a chain of one."""
    if plan.split:
        return [tuple((s.peer_id, s.start, s.end) for s in c) for c in plan.pipelines]
    return [((p, 0, model.n_layers),) for p in plan.replicas]


def plan_ranges(plan: Plan, model: ModelCost) -> dict[str, tuple[int, int]]:
    """Each peer's layers in `plan`, every chain's."""
    return {peer: (start, end) for chain in plan_chains(plan, model) for peer, start, end in chain}
