"""Models this agent takes no part in, served by peers: read from the placement claims the
peers gossip, as every agent reads them (`placement/negotiation.py`), so that this agent's API
answers for them too, forwarding each request to the model's entry (`api/elsewhere.py`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from meshagent.gossip.failure import PeerState
from meshagent.placement.negotiation import (
    plan_in_force,
    routable,
    serving_chains,
    serving_peers,
)
from meshagent.placement.service import EXTRAS_KEY, claims_for
from meshagent.serving.directory import RemoteModel

MAX_MODELS = 64  # model ids read from one peer's claims
MAX_ID = 256


def claimed_models(views: Mapping[str, Any]) -> set[str]:
    """The ids of the models alive peers gossip placement claims for."""
    out: set[str] = set()
    for view in views.values():
        if view.state == PeerState.DEAD:
            continue
        claims = view.record.extras.get(EXTRAS_KEY)
        if isinstance(claims, dict):
            ids = [k for k in claims if isinstance(k, str) and 0 < len(k) <= MAX_ID]
            out.update(ids[:MAX_MODELS])
    return out


def foreign_models(views: Mapping[str, Any], hosted: Collection[str]) -> list[RemoteModel]:
    """The models peers serve now (their plan in force routable) that are not in `hosted`
    (ids, casefolded): a split's entry, or each replica of a model served whole."""
    alive = {pid for pid, v in views.items() if v.state != PeerState.DEAD}
    out: list[RemoteModel] = []
    for model_id in sorted(claimed_models(views)):
        if model_id.casefold() in hosted:
            continue
        claims = claims_for(model_id, views)
        winner = plan_in_force(claims)
        if winner is None or not routable(winner, claims, alive):
            continue
        plan = winner.plan
        if plan.split:
            for chain in serving_chains(winner, claims, alive):  # each serves on its own
                stages = tuple((s.peer_id, s.start, s.end) for s in chain)
                entry, end = chain[0].peer_id, chain[-1].end
                out.append(
                    RemoteModel(
                        model_id, entry, "split", stages, end, peer_name=_name(views, entry)
                    )
                )
            continue
        for peer in serving_peers(winner, claims, alive):
            layers = next(
                (s.total_layers for s in views[peer].record.serving if s.model == model_id), 0
            )
            out.append(
                RemoteModel(model_id, peer, "whole", (), layers, peer_name=_name(views, peer))
            )
    return out


def _name(views: Mapping[str, Any], peer_id: str) -> str:
    view = views.get(peer_id)
    return view.record.name if view is not None and view.record is not None else ""
