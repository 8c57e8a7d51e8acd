"""The memory each model takes of each peer while the assignment (`assignment.py`) is made:
what a peer has free, a model's share of it (the smallest that holds a stage or a whole
replica, VRAM first), and a model's placement in the making (its shares, and a split's
chains with what each serves)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from meshagent.placement.planner import ModelCost, PeerCapacity, StageAssignment


def replica_share(
    model: ModelCost, free: PeerCapacity, *, context_tokens: int, headroom: float = 0.1
) -> PeerCapacity | None:
    """`free` (what is left of a peer's offer) cut to what one whole replica of `model`
    takes of it, VRAM first; None when it does not fit."""
    room = Free(free.memory_bytes, free.vram_bytes, free.spare_bytes)
    share = stage_share(model, 0, model.n_layers, context_tokens, room, headroom)
    if share is None:
        return None
    return replace(free, memory_bytes=share.memory, vram_bytes=share.vram, spare_bytes=share.spare)


@dataclass
class Free:
    memory: int
    vram: int
    spare: int


@dataclass(frozen=True)
class Share:
    memory: int
    vram: int
    spare: int


def stage_share(
    model: ModelCost, start: int, end: int, ctx: int, free: Free, headroom: float
) -> Share | None:
    """The smallest share of `free` whose usable part (less `headroom`) holds the stage
    over layers [start, end) as `PeerCapacity.needs` counts it; its VRAM part as much of
    the stage as the free VRAM takes (so that it runs on the device, as `stage_ms` counts
    it), with as much of the spare as llama.cpp's compute buffer takes. None if it does not
    fit."""
    compute = model.compute_bytes(end == model.n_layers)
    need = max(0, model.offer_bytes(start, end, ctx, free.spare))
    total = math.ceil(need / (1.0 - headroom))
    while int(total * (1.0 - headroom)) < need:
        total += 1
    vram = min(free.vram, max(total, model.stage_bytes(start, end, ctx)))
    memory = max(0, total - vram)
    if memory > free.memory:
        return None
    return Share(memory, vram, min(compute, free.spare))


class Chain(NamedTuple):
    """One chain of a split in the making: its peers, what it serves, and its stages."""

    peers: frozenset[str]
    rate: float  # tokens per second
    stages: tuple[StageAssignment, ...]  # in pipeline order


@dataclass
class Placing:
    """A model's placement while the assignment is made."""

    split: bool
    shares: dict[str, Share]  # by peer id
    split_rate: float = 0.0  # a split's tokens per second (its chains' estimates, summed)
    chains: list[Chain] = field(default_factory=list)  # a split's, the first one first

    def add_chain(
        self, shares: dict[str, Share], rate: float, stages: tuple[StageAssignment, ...]
    ) -> None:
        """One more chain of the split: `stages` on `shares`, serving `rate` tokens per
        second."""
        self.shares.update(shares)
        self.split_rate += rate
        self.chains.append(Chain(frozenset(shares), rate, stages))
