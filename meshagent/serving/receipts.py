"""Receipts: the response headers that say who served a request, and how (a split's stages
and the dtype its hidden states crossed the network in)."""

from __future__ import annotations

from meshagent.models.capability import WireChoice
from meshagent.placement.planner import Plan
from meshagent.serving.directory import Headers


def whole_receipt(peer_id: str, n_layers: int) -> Headers:
    """This agent served the whole model."""
    return [(b"x-meshagent-stages", f"{peer_id}:0-{n_layers}".encode())]


def split_receipt(plan: Plan, wire: WireChoice) -> Headers:
    """The stages of `plan` served it, their hidden states in `wire`'s dtype."""
    stages = ",".join(f"{st.peer_id}:{st.start}-{st.end}" for st in plan.stages)
    return [
        (b"x-meshagent-stages", stages.encode()),
        (b"x-meshagent-wire-dtype", wire.dtype.encode()),
        (b"x-meshagent-wire-exact", b"certified" if wire.certified_exact else b"no"),
    ]
