"""Agreeing on one plan per model without a master (pure functions over gossiped claims).

Every agent publishes, in its gossiped record, a claim for each model it takes part in: the
plan it follows (with its epoch and proposer) and whether its own part is loaded. The plan
in force is the claimed plan with the highest epoch; between different plans of the same epoch
the one proposed by the lowest peer id wins. So every agent that sees the same claims picks the
same plan. A new plan gets the next epoch; agents only propose one when the planner says the
gain passes the replan threshold (see `planner.should_replan`), so the mesh does not flap.
A split is routable once every peer of the plan in force claims that plan and is ready.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cbor2

from meshagent.errors import MeshError
from meshagent.placement.planner import Plan, StageAssignment

CLAIM_VERSION = 1


class ClaimError(MeshError):
    """A gossiped claim is malformed."""


def plan_digest(plan: Plan) -> str:
    body = cbor2.dumps(
        [
            plan.model_id,
            plan.context_tokens,
            list(plan.replicas),
            [[s.peer_id, s.start, s.end] for s in plan.stages],
        ]
    )
    return hashlib.sha256(body).hexdigest()[:16]


@dataclass(frozen=True)
class Claim:
    """One agent's position on one model's placement."""

    model_id: str
    epoch: int
    proposer: str
    plan: Plan
    ready: bool  # this agent's part of `plan` is loaded and serving
    version: int = CLAIM_VERSION

    @property
    def key(self) -> tuple[int, str, str]:
        """Higher wins: epoch first; then the lowest proposer (negated by sorting below)."""
        return (self.epoch, self.proposer, plan_digest(self.plan))

    def to_cbor(self) -> dict[int, Any]:
        p = self.plan
        return {
            0: self.version,
            1: self.model_id,
            2: self.epoch,
            3: self.proposer,
            4: p.context_tokens,
            5: list(p.replicas),
            6: [[s.peer_id, s.start, s.end] for s in p.stages],
            7: self.ready,
            8: p.est_token_ms,
        }

    @classmethod
    def from_cbor(cls, d: Any) -> Claim:
        try:
            if not isinstance(d, dict) or d[0] != CLAIM_VERSION:
                raise ClaimError("placement claim of an unknown version")
            stages = tuple(StageAssignment(str(a), int(b), int(c)) for a, b, c in d[6])
            plan = Plan(
                model_id=str(d[1]),
                context_tokens=int(d[4]),
                replicas=tuple(str(x) for x in d[5]),
                stages=stages,
                est_token_ms=float(d[8]),
            )
            return cls(str(d[1]), int(d[2]), str(d[3]), plan, bool(d[7]))
        except (KeyError, TypeError, ValueError) as e:
            raise ClaimError(f"malformed placement claim: {e}") from e


def plan_in_force(claims: Mapping[str, Claim]) -> Claim | None:
    """The claim whose plan every agent follows: highest epoch, then lowest proposer id, then
    lowest plan digest (claims by peer id; all for one model)."""
    if not claims:
        return None
    return min(claims.values(), key=lambda c: (-c.epoch, c.proposer, plan_digest(c.plan)))


def next_epoch(claims: Mapping[str, Claim]) -> int:
    return max((c.epoch for c in claims.values()), default=0) + 1


def serving_peers(winner: Claim, claims: Mapping[str, Claim], alive: set[str]) -> tuple[str, ...]:
    """The peers of the plan in force that are alive, follow it and have their part loaded."""
    digest = plan_digest(winner.plan)
    out = []
    for peer in winner.plan.peers:
        c = claims.get(peer)
        if peer not in alive or c is None or not c.ready:
            continue
        if c.epoch == winner.epoch and plan_digest(c.plan) == digest:
            out.append(peer)
    return tuple(out)


def routable(winner: Claim, claims: Mapping[str, Claim], alive: set[str]) -> bool:
    """A split: every stage's peer serves its part of the plan in force. A model served
    whole: at least one replica does (each replica serves on its own)."""
    ready = serving_peers(winner, claims, alive)
    if winner.plan.split:
        return len(ready) == len(winner.plan.peers)
    return bool(ready)


def my_part(plan: Plan, peer_id: str) -> StageAssignment | None:
    """This peer's assignment in `plan`: its stage, or the whole model as 0..n, or None."""
    for s in plan.stages:
        if s.peer_id == peer_id:
            return s
    return None
