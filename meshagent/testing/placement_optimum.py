"""The exact optimum of a split under the planner's cost model, by exhaustion, for meshes small
enough to enumerate (up to about 14 peers): the yardstick `bench/placement.py` holds the
planner's search to.

The cost of a split is its stages' compute plus one trip around the ring. For a model whose
layers are all the same size and peers without GPUs (each stage's time linear in its layers),
it separates: given the set of peers and which one is first and which last, the least compute
gives each peer one layer and the rest to the fastest peers up to what their memory holds (the
first holds the embeddings too, the last the output head and the largest compute buffer); the
least ring through the set from the first to the last is a Held-Karp shortest path. Both are
computed for every set at once with numpy, and the optimum is the least sum over all sets and
ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshagent.placement.costs import ModelCost, PeerCapacity, rtt_between, usable


def layer_caps(
    model: ModelCost, peer: PeerCapacity, context_tokens: int, headroom: float
) -> tuple[int, int, int]:
    """The most layers `peer` holds as the first, a middle and the last stage (layers of one
    size: where the range starts does not matter)."""
    n, room = model.n_layers, usable(peer, headroom)

    def most(fits) -> int:
        best = 0
        for c in range(1, n):
            if not fits(c):
                break
            best = c
        return best

    ctx = context_tokens
    first = most(lambda c: peer.needs(model, 0, c, ctx) <= room)
    middle = most(lambda c: c < n - 1 and peer.needs(model, 1, 1 + c, ctx) <= room)
    last = most(lambda c: peer.needs(model, n - c, n, ctx) <= room)
    return first, middle, last


def optimum(
    model: ModelCost,
    peers: Sequence[PeerCapacity],
    *,
    context_tokens: int,
    headroom: float,
    unknown_rtt: float,
) -> float:
    """The least estimated ms per token of any split of `model` over any two or more of
    `peers` (inf when none fits). Layers must all be the same size and peers have no GPU."""
    if len(set(model.layer_bytes)) > 1:
        raise ValueError("the exhaustive optimum needs layers of one size")
    if any(p.vram_bytes for p in peers):
        raise ValueError("the exhaustive optimum is for peers without GPUs")
    m, n = len(peers), model.n_layers
    full = 1 << m
    rtt = np.array(
        [[rtt_between(a, b, unknown_rtt) for b in peers] for a in peers], dtype=np.float64
    )
    # path[mask, a, b]: the shortest path from a to b through every peer of mask
    path = np.full((full, m, m), np.inf)
    for a in range(m):
        path[1 << a, a, a] = 0.0
    sizes = np.array([bin(x).count("1") for x in range(full)])
    member = (np.arange(full)[:, None] >> np.arange(m)[None, :]) & 1 == 1  # [mask, peer]
    for size in range(1, m):
        masks = np.nonzero(sizes == size)[0]
        for j in range(m):
            without = masks[~member[masks, j]]
            if not len(without):
                continue
            # from any end b of each path, on to j
            step = path[without][:, :, :] + rtt[None, None, :, j]  # [mask, a, b]
            best = step.min(axis=2)  # [mask, a]
            target = without | (1 << j)
            np.minimum.at(path, (target[:, None], np.arange(m)[None, :], j), best)
    caps = np.array([layer_caps(model, p, context_tokens, headroom) for p in peers])
    ms_per_layer = np.array([1000.0 / max(p.speed, 1e-9) for p in peers])
    by_speed = sorted(range(m), key=lambda i: (ms_per_layer[i], peers[i].peer_id))
    masks = np.arange(full)
    best = np.inf
    for f in range(m):
        for last in range(m):
            if f == last:
                continue
            ok = member[:, f] & member[:, last] & (sizes >= 2) & (sizes <= n)
            cap = np.where(member, caps[:, 1][None, :], 0)
            cap[:, f] = np.where(member[:, f], caps[f, 0], 0)
            cap[:, last] = np.where(member[:, last], caps[last, 2], 0)
            ok &= ((cap >= 1) | ~member).all(axis=1)
            left = np.where(ok, n - sizes, 0).astype(np.int64)
            compute = (sizes * 0).astype(np.float64)
            for i in by_speed:
                inside = member[:, i]
                give = np.where(inside, np.minimum(np.maximum(cap[:, i] - 1, 0), left), 0)
                left = left - give
                compute += np.where(inside, (1 + give) * ms_per_layer[i], 0.0)
            ok &= left == 0
            ring = path[masks, f, last] + rtt[last, f]
            total = np.where(ok, compute + ring, np.inf)
            best = min(best, float(total.min()))
    return best
