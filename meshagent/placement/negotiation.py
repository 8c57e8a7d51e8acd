"""Agreeing on one plan per model without a master (pure functions over gossiped claims).

Every agent publishes, in its gossiped record, a claim for each model it takes part in: the
plan it follows (with its epoch and proposer) and whether its own part is loaded. The plan
in force is the claimed plan with the highest epoch; between different plans of the same epoch
the one proposed by the lowest peer id wins. So every agent that sees the same claims picks the
same plan. A new plan gets the next epoch; agents only propose one when the planner says the
gain passes the replan threshold (see `planner.should_replan`), so the mesh does not flap.
A split is routable once every peer of the plan in force claims that plan and is ready.

A claim is read once, where gossip brings it (`Claim.from_cbor`), against what the reader
knows of the model (its id, its layer count): every field of its type and range, a plan
whole (replicas) or split (stages from layer 0 to the last, one peer each). Anything else is
a ClaimError naming the field, and that peer's claim is left out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cbor2

from meshagent.errors import MeshError
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.wire.quoted import quoted

CLAIM_VERSION = 1
# The ranges of a claim's fields.
EPOCHS = range(2**63)
CONTEXTS = range(1, 2**31)
LAYERS = range(1 << 16)
MAX_PEERS = 256  # replicas or stages of one plan
MAX_PEER_ID = 64
MAX_MODEL_ID = 255


class ClaimError(MeshError):
    """A gossiped claim is malformed."""


def plan_digest(plan: Plan) -> str:
    fields: list[Any] = [
        plan.model_id,
        plan.context_tokens,
        list(plan.replicas),
        _wire_stages(plan.stages),
    ]
    if plan.chains:  # (a plan of one chain keeps the digest it had before chains)
        fields.append([_wire_stages(c) for c in plan.chains])
    return hashlib.sha256(cbor2.dumps(fields)).hexdigest()[:16]


def _wire_stages(stages: tuple[StageAssignment, ...]) -> list[list[Any]]:
    return [[s.peer_id, s.start, s.end] for s in stages]


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
            6: _wire_stages(p.stages),
            7: self.ready,
            8: p.est_token_ms,
            **({9: [_wire_stages(c) for c in p.chains]} if p.chains else {}),
        }

    @classmethod
    def from_cbor(
        cls, d: Any, *, model_id: str | None = None, n_layers: int | None = None
    ) -> Claim:
        """A gossiped claim, for `model_id` and its `n_layers` where given; ClaimError
        naming the first field out of its range."""
        if not isinstance(d, dict):
            raise ClaimError(f"a placement claim is a map, not {quoted(d)}")
        version = d.get(0)
        if type(version) is not int or version != CLAIM_VERSION:  # True and 1.0 equal 1
            raise ClaimError(f"placement claim of version {quoted(version)}, not {CLAIM_VERSION}")
        model = _text(d.get(1), "model id", MAX_MODEL_ID)
        if model_id is not None and model != model_id:
            raise ClaimError(f"placement claim for model {quoted(model)}, not {model_id!r}")
        replicas = _peers(d.get(5), "replicas", "replica")
        stages = _stages(d.get(6), n_layers)
        if bool(replicas) == bool(stages):
            raise ClaimError(
                "placement claim's plan names replicas or stages, one of them: "
                f"{len(replicas)} replicas and {len(stages)} stages"
            )
        chains = _chains(d.get(9, []), n_layers, stages)
        ready = d.get(7)
        if type(ready) is not bool:
            raise ClaimError(f"placement claim's ready is {quoted(ready)}, not true or false")
        est = d.get(8)
        # A plan on a peer of (absurdly) tiny speed is estimated at infinity: still a plan.
        if not (type(est) is float or (type(est) is int and est < 2**53)) or not est >= 0:
            raise ClaimError(f"placement claim's est_token_ms is {quoted(est)}, not a number >= 0")
        plan = Plan(
            model_id=model,
            context_tokens=_int(d.get(4), "context tokens", CONTEXTS),
            replicas=replicas,
            stages=stages,
            est_token_ms=float(est),
            chains=chains,
        )
        proposer = _text(d.get(3), "proposer", MAX_PEER_ID)
        return cls(model, _int(d.get(2), "epoch", EPOCHS), proposer, plan, ready)


def _int(v: Any, what: str, allowed: range) -> int:
    if type(v) is not int or v not in allowed:
        raise ClaimError(
            f"placement claim's {what} is {quoted(v)}, not an integer of "
            f"{allowed.start}-{allowed.stop - 1}"
        )
    return v


def _text(v: Any, what: str, most: int) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= most:
        raise ClaimError(
            f"placement claim's {what} is {quoted(v)}, not text of 1-{most} characters"
        )
    return v


def _peers(v: Any, what: str, each: str) -> tuple[str, ...]:
    if not isinstance(v, list) or len(v) > MAX_PEERS:
        shown = f"{len(v)} of them" if isinstance(v, list) else quoted(v)
        raise ClaimError(
            f"placement claim's {what} ({shown}) are not a list of at most {MAX_PEERS}"
        )
    peers = tuple(_text(p, each, MAX_PEER_ID) for p in v)
    if len(set(peers)) != len(peers):
        raise ClaimError(f"placement claim's {what} name a peer twice: {quoted(list(peers))}")
    return peers


def _stages(v: Any, n_layers: int | None) -> tuple[StageAssignment, ...]:
    """A split's stages: one peer each, from layer 0 to the last without gap or overlap."""
    if not isinstance(v, list) or len(v) > MAX_PEERS:
        shown = f"{len(v)} of them" if isinstance(v, list) else quoted(v)
        raise ClaimError(
            f"placement claim's stages ({shown}) are not a list of at most {MAX_PEERS}"
        )
    stages, end = [], 0
    for s in v:
        if not isinstance(s, list) or len(s) != 3:
            raise ClaimError(f"placement claim's stage {quoted(s)} is not [peer, start, end]")
        peer = _text(s[0], "stage host", MAX_PEER_ID)
        start, stop = _int(s[1], "stage start", LAYERS), _int(s[2], "stage end", LAYERS)
        if start != end or stop <= start:
            raise ClaimError(
                f"placement claim's stage {quoted(s)} does not follow layer {end}: stages run "
                "from layer 0 to the last, each over at least one"
            )
        stages.append(StageAssignment(peer, start, stop))
        end = stop
    if stages and n_layers is not None and end != n_layers:
        raise ClaimError(
            f"placement claim's stages end at layer {end}, not at the model's {n_layers}"
        )
    _peers([s.peer_id for s in stages], "stages", "stage host")
    return tuple(stages)


def _chains(
    v: Any, n_layers: int | None, first: tuple[StageAssignment, ...]
) -> tuple[tuple[StageAssignment, ...], ...]:
    """A split's further chains: each as its stages are, no peer in two chains, and at most
    `MAX_PEERS` peers in all."""
    if not isinstance(v, list) or len(v) > MAX_PEERS:
        shown = f"{len(v)} of them" if isinstance(v, list) else quoted(v)
        raise ClaimError(
            f"placement claim's chains ({shown}) are not a list of at most {MAX_PEERS}"
        )
    if v and not first:
        raise ClaimError("placement claim names further chains of a model served whole")
    chains = []
    for c in v:
        chain = _stages(c, n_layers)
        if not chain:
            raise ClaimError("placement claim names an empty chain")
        chains.append(chain)
    hosts = [s.peer_id for chain in (first, *chains) for s in chain]
    if len(hosts) > MAX_PEERS:
        raise ClaimError(
            f"placement claim's chains name {len(hosts)} peers in all, more than {MAX_PEERS}"
        )
    _peers(hosts, "chains", "stage host")
    return tuple(chains)


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
    """A split: every stage's peer of one chain at least serves its part of the plan in
    force. A model served whole: at least one replica does (each replica serves on its
    own)."""
    if winner.plan.split:
        return bool(serving_chains(winner, claims, alive))
    return bool(serving_peers(winner, claims, alive))


def serving_chains(
    winner: Claim, claims: Mapping[str, Claim], alive: set[str]
) -> tuple[tuple[StageAssignment, ...], ...]:
    """The chains of a split in force whose every peer serves its part, in the plan's order."""
    ready = set(serving_peers(winner, claims, alive))
    return tuple(c for c in winner.plan.pipelines if all(s.peer_id in ready for s in c))


def my_part(plan: Plan, peer_id: str) -> StageAssignment | None:
    """This peer's assignment in `plan`: its stage, or the whole model as 0..n, or None."""
    for chain in plan.pipelines:
        for s in chain:
            if s.peer_id == peer_id:
                return s
    return None
