"""Exact cuts: for peers in a chosen order, the contiguous layer ranges that give the least
estimated time per token, within each peer's memory to the byte.

The time of a split is the sum of its stages' compute times (a token passes every stage in
turn) plus one trip around the ring, which the order alone fixes; so for a given order the cut
minimises the sum of the stages' times (`PeerCapacity.stage_ms`), each stage within its peer's
usable memory (`PeerCapacity.needs`: exact layer bytes, the first stage's embeddings, the last
one's output head and compute buffer). Among cuts of equal time the one whose slowest stage is
fastest wins (equal peers get equal shares), then the one with the earliest boundaries.

A dynamic program over (stage, layers covered so far): stage i covering [a, b) costs
`ms_i[a, b]`, an n+1 by n+1 table per peer and role (first, middle, last, or whole), computed
once per search from prefix sums of the layer bytes and kept (`StageCosts`). The tables are
numpy arrays of float64 built by elementwise operations only, so every agent computes the same
bits and therefore the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshagent.placement.costs import ModelCost, PeerCapacity, StageAssignment

FIRST, MIDDLE, LAST = "first", "middle", "last"
# Sums of stage times that differ by less than this (ms) are ties, broken by balance.
TIE_MS = 1e-6


class StageCosts:
    """Each peer's time for each layer range it could hold in each role, for one model, context
    and headroom: `table(peer, role)[a, b]` is the ms per token of layers [a, b) there, inf
    where the range does not fit (or cannot be that role's)."""

    def __init__(self, model: ModelCost, context_tokens: int, headroom: float) -> None:
        self.model = model
        self.context_tokens = context_tokens
        self.headroom = headroom
        n = model.n_layers
        self.n = n
        prefix = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.asarray(model.layer_bytes, dtype=np.int64), out=prefix[1:])
        idx = np.arange(n + 1, dtype=np.int64)
        a, b = idx[:, None], idx[None, :]
        self.layers = (b - a).astype(np.int64)  # [a, b]: b - a (negative below the diagonal)
        kv = model.kv_bytes_per_token_per_layer * context_tokens
        # weights and KV cache of layers [a, b) and every stage's other bytes
        self._body = (prefix[None, :] - prefix[:, None]) + kv * self.layers + model.other_bytes
        self._valid = self.layers > 0
        self._cache: dict[tuple[str, str], np.ndarray] = {}

    def table(self, peer: PeerCapacity, role: str) -> np.ndarray:
        key = (peer.peer_id, role)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._table(peer, role)
        return got

    def _table(self, peer: PeerCapacity, role: str) -> np.ndarray:
        m, n = self.model, self.n
        last = role == LAST
        compute = m.compute_bytes(last)
        need = self._body + compute  # model.stage_bytes
        valid = self._valid.copy()
        if role == FIRST:
            need = need + m.embedding_bytes
            valid[1:, :] = False  # starts at 0
            valid[:, n] = False  # and is not also the last
        elif role == LAST:
            need = need + m.head_bytes + m.standin_bytes
            valid[:, :n] = False  # ends at n
            valid[0, :] = False  # and is not also the first
        else:
            valid[0, :] = False
            valid[:, n] = False
        offer_need = need - min(compute, peer.spare_bytes)  # PeerCapacity.needs
        usable = int((peer.memory_bytes + peer.vram_bytes) * (1.0 - self.headroom))
        fits = valid & (offer_need <= usable)
        layers = self.layers.astype(np.float64)
        cpu_ms = 1000.0 * layers / max(peer.speed, 1e-9)
        if peer.vram_bytes > 0 and peer.vram_speed > 0:
            on_device = np.minimum(1.0, peer.vram_bytes / np.maximum(need, 1).astype(np.float64))
            ms = on_device * 1000.0 * layers / peer.vram_speed + (1.0 - on_device) * cpu_ms
        else:
            ms = cpu_ms
        if role == FIRST:  # the entry runs its draft model too
            ms = ms + peer.draft_ms(m)
        return np.where(fits, ms, np.inf)


def cut(
    costs: StageCosts, order: Sequence[PeerCapacity]
) -> tuple[tuple[StageAssignment, ...], float] | None:
    """The least-time cut of the model over `order` (two or more peers) and its compute ms per
    token; None when no cut fits."""
    k, n = len(order), costs.n
    if k < 2 or k > n:
        return None
    inf = np.inf
    # total[a]: least sum of times covering layers [0, a); worst[a]: its slowest stage
    total = np.full(n + 1, inf)
    worst = np.full(n + 1, inf)
    total[0], worst[0] = 0.0, 0.0
    back = []
    for i, peer in enumerate(order):
        role = FIRST if i == 0 else LAST if i == k - 1 else MIDDLE
        ms = costs.table(peer, role)
        cand = total[:, None] + ms  # [a, b]
        best = cand.min(axis=0)
        if not np.isfinite(best).any():
            return None
        tied = cand <= best[None, :] + TIE_MS
        slowest = np.where(tied, np.maximum(worst[:, None], ms), inf)
        least = slowest.min(axis=0)
        # the earliest boundary among the tied ones whose slowest stage is least
        pick = np.argmax(tied & (slowest <= least[None, :]), axis=0)
        back.append(pick)
        total = np.where(np.isfinite(best), cand[pick, np.arange(n + 1)], inf)
        worst = np.where(np.isfinite(best), least, inf)
    if not np.isfinite(total[n]):
        return None
    bounds = [n]
    for pick in reversed(back):
        bounds.append(int(pick[bounds[-1]]))
    bounds.reverse()
    if bounds[0] != 0:
        return None
    stages = tuple(
        StageAssignment(p.peer_id, bounds[i], bounds[i + 1]) for i, p in enumerate(order)
    )
    return stages, float(total[n])
