"""Which peers hold a split, in which order: a search over the whole mesh.

A split's estimated time per token is its stages' compute (the exact cut for the order,
`cuts.cut`) plus one trip around the ring of measured RTTs. A handful of candidates is
enumerated outright: every order of every subset. Beyond that, the search starts from a few
sets (the fastest peers until their memory holds the model; the roomiest, which needs the
fewest stages; clusters grown by RTT around the strongest peers), orders each set into a short
ring (nearest neighbour, then 2-opt), tries the rotations that put a roomy peer at either end
(the first stage holds the embeddings, the last the output head and the largest compute
buffer), and then improves the best set by dropping, adding and swapping peers while that
lowers the estimate.

Every step is deterministic (peers sorted by id, fixed candidate lists, ties broken by peer id,
a budget counted in evaluations rather than seconds), so agents that see the same snapshot
reach the same plan. `bench/placement.py` measures the result against the exhaustive optimum
on small meshes and the time it takes on meshes of up to a thousand peers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from meshagent.placement.costs import (
    ModelCost,
    PeerCapacity,
    StageAssignment,
    rank_speed,
    ring_ms,
    rtt_between,
    usable,
)
from meshagent.placement.cuts import FIRST, LAST, MIDDLE, StageCosts, cut

# (est. ms per token, peer order, stages, bytes its peers must download first)
Option = tuple[float, tuple[str, ...], tuple[StageAssignment, ...], int]

MAX_STAGES = 32  # stages in one split
EXHAUSTIVE_ORDERS = 400  # enumerate every order of every subset up to this many orders
# The work of one search, at most: stages cut (a cut of k stages counts k), so that it is
# bounded alike for many short splits and few long ones.
MAX_WORK = 20_000
NEIGHBOURS = 6  # peers outside the set tried for adding and swapping at each step
DROPS = 3  # the slowest and the smallest members tried for dropping and swapping
SEEDS = 4  # peers a cluster is grown around
SMALL = 16  # a mesh of at most this many candidates: every peer is a seed and a neighbour
BOUNDED = 12  # at most this many candidates: every set, by branch and bound
EVERY_ORDER = 4  # a set of at most this many peers is tried in every order


class Search:
    def __init__(
        self,
        model: ModelCost,
        peers: Sequence[PeerCapacity],
        *,
        context_tokens: int,
        headroom: float,
        unknown_rtt: float,
    ) -> None:
        self.model = model
        self.ctx = context_tokens
        self.headroom = headroom
        self.unknown = unknown_rtt
        self.costs = StageCosts(model, context_tokens, headroom)
        self.evaluations = 0
        self.work = 0
        self._orders: dict[tuple[str, ...], Option | None] = {}
        self._sets: dict[frozenset[str], Option | None] = {}
        # Peers that can hold one layer of the middle of the model, by id.
        one = min(
            model.stage_bytes(i, i + 1, context_tokens) - model.compute_bytes(False)
            for i in range(model.n_layers)
        )
        self.pool = sorted(
            (p for p in peers if usable(p, headroom) >= one), key=lambda p: p.peer_id
        )
        self.need = model.stage_bytes(0, model.n_layers, context_tokens)
        # what any split needs at least: the weights and KV cache (its compute buffers may go
        # to the memory beyond the peers' offers)
        self.floor = self.need - model.compute_bytes(True)

    # ----- the answer -----

    def options(self) -> list[Option]:
        """Every feasible split the search evaluated (the best among them first-class)."""
        m = len(self.pool)
        if _orders_count(m) <= EXHAUSTIVE_ORDERS:
            for k in range(2, min(m, MAX_STAGES, self.model.n_layers) + 1):
                for subset in itertools.combinations(self.pool, k):
                    if sum(usable(p, self.headroom) for p in subset) < self.floor:
                        continue
                    for order in itertools.permutations(subset):
                        self.order(order)
        elif m <= BOUNDED:
            self._bounded()
        else:
            self._local_search()
        return [o for o in self._orders.values() if o is not None]

    # ----- evaluations -----

    def order(self, order: Sequence[PeerCapacity]) -> Option | None:
        """The split over peers in this order: its exact cut and estimated time."""
        key = tuple(p.peer_id for p in order)
        if key in self._orders:
            return self._orders[key]
        if self.work >= MAX_WORK:
            return None
        self.evaluations += 1
        self.work += len(order)
        got = cut(self.costs, order)
        option = None
        if got is not None:
            stages, compute_ms = got
            ring = ring_ms(order, self.unknown)
            download = sum(
                p.download_bytes(self.model, s.start, s.end)
                for s, p in zip(stages, order, strict=True)
            )
            option = (compute_ms + ring, key, stages, download)
        self._orders[key] = option
        return option

    def members(self, members: Sequence[PeerCapacity]) -> Option | None:
        """The best split found over exactly these peers: a short ring, tried with each
        roomy peer at either end and in both directions."""
        key = frozenset(p.peer_id for p in members)
        if key in self._sets:
            return self._sets[key]
        best: Option | None = None
        if 2 <= len(members) <= min(MAX_STAGES, self.model.n_layers) and (
            sum(usable(p, self.headroom) for p in members) >= self.floor
        ):
            orders = (
                itertools.permutations(sorted(members, key=lambda p: p.peer_id))
                if len(members) <= EVERY_ORDER
                else self._rotations(self._ring(members))
            )
            for order in orders:
                option = self.order(order)
                if option is not None and (best is None or option[:2] < best[:2]):
                    best = option
        self._sets[key] = best
        return best

    # ----- every set, by branch and bound -----

    def _bounded(self) -> None:
        """Every set of peers, in the order of a lower bound on its estimate, each evaluated
        (`members`) until the bound reaches the best estimate found."""
        pool, n = self.pool, self.model.n_layers
        caps, rates = [], []
        for p in pool:
            most, rate = 0, math.inf
            for role in (FIRST, MIDDLE, LAST):
                t = self.costs.table(p, role)
                ok = np.isfinite(t)
                if ok.any():
                    layers = self.costs.layers[ok]
                    most = max(most, int(layers.max()))
                    rate = min(rate, float((t[ok] / layers).min()))
            caps.append(most)
            rates.append(rate)
        rtt = [[self._rtt(a, b) for b in pool] for a in pool]
        bounds = []
        for mask in range(1, 1 << len(pool)):
            s = [i for i in range(len(pool)) if mask >> i & 1]
            if len(s) < 2 or len(s) > min(MAX_STAGES, n) or sum(caps[i] for i in s) < n:
                continue
            if any(caps[i] < 1 for i in s):
                continue
            # compute: a layer each, the rest at the cheapest rates the caps allow
            compute, left = sum(rates[i] for i in s), n - len(s)
            for i in sorted(s, key=lambda i: rates[i]):
                give = min(caps[i] - 1, left)
                compute += give * rates[i]
                left -= give
            # a ring enters and leaves each peer: at least half its two shortest edges
            if len(s) == 2:
                ring = 2 * rtt[s[0]][s[1]]
            else:
                ring = sum(sum(sorted(rtt[i][j] for j in s if j != i)[:2]) for i in s) / 2
            bounds.append((compute + ring, mask, s))
        bounds.sort(key=lambda b: (b[0], b[1]))
        best = math.inf
        for bound, _, s in bounds:
            if bound >= best - 1e-9 or self.work >= MAX_WORK:
                return
            option = self.members([pool[i] for i in s])
            if option is not None:
                best = min(best, option[0])

    # ----- rings -----

    def _rtt(self, a: PeerCapacity, b: PeerCapacity) -> float:
        return rtt_between(a, b, self.unknown)

    def _ring(self, members: Sequence[PeerCapacity]) -> list[PeerCapacity]:
        """A short ring through `members`: nearest neighbour from the lowest id, then 2-opt."""
        left = sorted(members, key=lambda p: p.peer_id)
        ring = [left.pop(0)]
        while left:
            here = ring[-1]
            nxt = min(left, key=lambda p: (self._rtt(here, p), p.peer_id))
            left.remove(nxt)
            ring.append(nxt)
        k = len(ring)
        improved = k > 3
        passes = 0
        while improved and passes < 8:
            improved, passes = False, passes + 1
            for i in range(k - 1):
                for j in range(i + 2, k if i else k - 1):
                    a, b = ring[i], ring[i + 1]
                    c, d = ring[j], ring[(j + 1) % k]
                    now = self._rtt(a, b) + self._rtt(c, d)
                    then = self._rtt(a, c) + self._rtt(b, d)
                    if then < now - 1e-9:
                        ring[i + 1 : j + 1] = reversed(ring[i + 1 : j + 1])
                        improved = True
        return ring

    def _rotations(self, ring: list[PeerCapacity]) -> list[list[PeerCapacity]]:
        """Orders of the same ring (the same RTTs): every rotation either way for a short
        ring, else the two that put the roomiest peer first or last."""
        k = len(ring)
        if k <= 6:
            return [r[s:] + r[:s] for r in (ring, ring[::-1]) for s in range(k)]
        roomy = min(ring, key=lambda p: (-usable(p, self.headroom), p.peer_id))
        i = next(j for j, p in enumerate(ring) if p.peer_id == roomy.peer_id)
        return [ring[i:] + ring[:i], ring[i + 1 :] + ring[: i + 1]]

    # ----- the local search -----

    def _starts(self) -> list[list[PeerCapacity]]:
        """Sets to start from: each takes peers in some order until their memory holds the
        model."""
        pool, h = self.pool, self.headroom

        def until_enough(ranked: Sequence[PeerCapacity]) -> list[PeerCapacity]:
            got, room = [], 0
            for p in ranked:
                got.append(p)
                room += usable(p, h)
                if room >= self.need * 1.05 and len(got) >= 2:
                    break
            return got

        fastest = sorted(pool, key=lambda p: (-rank_speed(p), p.peer_id))
        roomiest = sorted(pool, key=lambda p: (-usable(p, h), p.peer_id))
        # the fastest of those roomy enough that `MAX_STAGES` of them hold the model
        share = self.need / (MAX_STAGES * 0.8)
        fast_roomy = [p for p in fastest if usable(p, h) >= share]
        starts = [until_enough(fastest), until_enough(roomiest), until_enough(fast_roomy)]
        strongest = sorted(pool, key=lambda p: (-usable(p, h) * rank_speed(p), p.peer_id))
        for seed in strongest if len(pool) <= SMALL else strongest[:SEEDS]:
            near = sorted(
                (p for p in pool if p.peer_id != seed.peer_id),
                key=lambda p: (self._rtt(seed, p), -rank_speed(p), p.peer_id),
            )
            starts.append(until_enough([seed, *near]))
        return starts

    def _local_search(self) -> None:
        best: tuple[Option, list[PeerCapacity]] | None = None
        for start in self._starts():
            members = list(start)
            option = self.members(members)
            # a start whose memory is not quite enough in the cut takes one more peer
            taken = {p.peer_id for p in members}
            extra = [p for p in self._by_speed() if p.peer_id not in taken]
            while option is None and extra and len(members) < MAX_STAGES:
                members.append(extra.pop(0))
                option = self.members(members)
            if option is not None and (best is None or option[:2] < best[0][:2]):
                best = (option, members)
        if best is None:
            return
        option, members = best
        while self.work < MAX_WORK:
            step = self._improve(members, option)
            if step is None:
                return
            option, members = step

    def _by_speed(self) -> list[PeerCapacity]:
        return sorted(self.pool, key=lambda p: (-rank_speed(p), p.peer_id))

    def _improve(
        self, members: list[PeerCapacity], current: Option
    ) -> tuple[Option, list[PeerCapacity]] | None:
        """The best neighbouring set (one peer dropped, added or swapped), if it is faster."""
        inside = {p.peer_id for p in members}
        outside = [p for p in self.pool if p.peer_id not in inside]

        def closeness(p: PeerCapacity) -> float:
            return sum(self._rtt(p, q) for q in members) / len(members)

        by_speed = sorted(outside, key=lambda p: (-rank_speed(p), p.peer_id))
        near = sorted(outside, key=lambda p: (closeness(p), -rank_speed(p), p.peer_id))
        few = NEIGHBOURS if len(self.pool) > SMALL else len(self.pool)
        adds = list({p.peer_id: p for p in [*by_speed[:few], *near[:few]]}.values())
        h = self.headroom
        drops = DROPS if len(self.pool) > SMALL else len(members)
        slowest = sorted(members, key=lambda p: (rank_speed(p), p.peer_id))[:drops]
        smallest = sorted(members, key=lambda p: (usable(p, h), p.peer_id))[:drops]
        weak = list({p.peer_id: p for p in [*slowest, *smallest]}.values())
        tries: list[list[PeerCapacity]] = []
        tries += [[q for q in members if q is not p] for p in weak]
        tries += [[*members, c] for c in adds]
        for p in slowest:
            # faster peers with about as much room: they can take its place
            room = usable(p, h) * 0.9
            able = [c for c in by_speed if usable(c, h) >= room and rank_speed(c) > rank_speed(p)]
            tries += [[c if q is p else q for q in members] for c in able[:few]]
        best: tuple[Option, list[PeerCapacity]] | None = None
        for t in tries:
            option = self.members(t)
            if option is None or option[0] >= current[0] - 1e-9:
                continue
            if best is None or option[:2] < best[0][:2]:
                best = (option, t)
        return best


def _orders_count(m: int) -> int:
    """Orders of every subset of two or more of m peers."""
    return sum(math.perm(m, k) for k in range(2, m + 1))
