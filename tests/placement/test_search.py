"""Splits over big meshes: the exact cut for an order, the search over the whole mesh, and the
exhaustive optimum the benchmark measures them against."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.placement.costs import rtt_between
from meshagent.placement.cuts import StageCosts, cut
from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    PlanError,
    plan,
    unknown_rtt,
    usable,
)
from meshagent.placement.search import MAX_STAGES, MAX_WORK, Search
from meshagent.testing.placement_optimum import optimum

MB, GB = 10**6, 10**9
CTX = 1000


def _model(n: int, rng: random.Random, *, uniform: bool = False) -> ModelCost:
    layers = (80 * MB,) * n if uniform else tuple(rng.randint(50, 120) * MB for _ in range(n))
    return ModelCost(
        "m", n, layers, 60 * MB, 70 * MB, MB, 1000, n_embd=rng.choice([0, 512]), n_vocab=32000
    )


def _peers(rng: random.Random, k: int, *, gpus: bool = False) -> list[PeerCapacity]:
    ids = [f"p{i}" for i in range(k)]
    out = []
    for pid in ids:
        rtts = {q: float(rng.randint(1, 90)) for q in ids if q != pid}
        gpu = gpus and rng.random() < 0.4
        out.append(
            PeerCapacity(
                pid,
                rng.randint(2, 12) * 10**8,
                rng.uniform(10, 400),
                rtts,
                vram_bytes=3 * 10**8 if gpu else 0,
                vram_speed=800.0 if gpu else 0.0,
                spare_bytes=rng.choice([0, 10**8]),
            )
        )
    return out


def _by_hand(model: ModelCost, order, headroom: float = 0.1):
    """The least sum of stage times over every cut of the model for peers in this order."""
    n, best = model.n_layers, None
    for inner in itertools.combinations(range(1, n), len(order) - 1):
        bounds = (0, *inner, n)
        total = 0.0
        for i, p in enumerate(order):
            a, b = bounds[i], bounds[i + 1]
            if p.needs(model, a, b, CTX) > usable(p, headroom):
                break
            total += p.stage_ms(model, a, b, CTX)
        else:
            best = total if best is None else min(best, total)
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 12), st.integers(2, 4), st.randoms(use_true_random=False))
def test_the_cut_is_the_least_time_of_every_cut_that_fits(n, k, rnd):
    # exact bytes per layer, the ends' embeddings and head, compute buffers, GPUs
    model = _model(n, rnd)
    order = _peers(rnd, min(k, n), gpus=True)
    got = cut(StageCosts(model, CTX, 0.1), order)
    want = _by_hand(model, order)
    assert (got is None) == (want is None)
    if got is not None:
        stages, ms = got
        assert abs(ms - want) < 1e-6
        assert stages[0].start == 0 and stages[-1].end == n
        for s, p in zip(stages, order, strict=True):
            assert s.peer_id == p.peer_id and s.end > s.start
            assert p.needs(model, s.start, s.end, CTX) <= usable(p, 0.1)


def _every_order(model: ModelCost, peers) -> float:
    """The least estimate of any split over any order of any two or more peers, by hand."""
    costs, unknown, best = StageCosts(model, CTX, 0.1), unknown_rtt(peers), float("inf")
    for k in range(2, len(peers) + 1):
        for order in itertools.permutations(peers, k):
            got = cut(costs, order)
            if got is not None:
                ring = sum(rtt_between(order[i], order[(i + 1) % k], unknown) for i in range(k))
                best = min(best, got[1] + ring)
    return best


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 5), st.randoms(use_true_random=False))
def test_the_exhaustive_optimum_is_the_best_order_of_every_subset(m, rnd):
    model = _model(12, rnd, uniform=True)
    peers = [
        PeerCapacity(p.peer_id, p.memory_bytes, p.speed, p.rtt_ms, spare_bytes=p.spare_bytes)
        for p in _peers(rnd, m)
    ]
    by_hand = _every_order(model, peers)
    exact = optimum(model, peers, context_tokens=CTX, headroom=0.1, unknown_rtt=unknown_rtt(peers))
    assert abs(exact - by_hand) < 1e-6 or exact == by_hand == float("inf")
    # The planner searches a mesh this small outright.
    if by_hand < float("inf") and not any(
        usable(p, 0.1) >= p.needs(model, 0, 12, CTX) for p in peers
    ):
        assert abs(plan(model, peers, context_tokens=CTX).est_token_ms - by_hand) < 1e-6


def _big_mesh(n: int, seed: int) -> tuple[ModelCost, list[PeerCapacity]]:
    rng = random.Random(seed)
    model = ModelCost(
        "70b", 80, (520 * MB,) * 80, 640 * MB, 860 * MB, 32_768, 4096, n_embd=8192,
        n_vocab=128256,
    )  # fmt: skip
    ids = [f"p{rng.getrandbits(40):010x}" for _ in range(n)]
    city = [rng.randrange(3) for _ in range(n)]
    far = {(0, 1): 70.0, (0, 2): 140.0, (1, 2): 65.0}
    peers = []
    for i, pid in enumerate(ids):
        rtts = {
            q: (
                rng.uniform(2, 15) if city[i] == city[j] else far[tuple(sorted((city[i], city[j])))]
            )
            for j, q in enumerate(ids)
            if j != i
        }
        gb = rng.choice([2, 4, 8, 8, 16])
        peers.append(PeerCapacity(pid, gb * GB, rng.uniform(30, 200), rtts))
    return model, peers


def test_a_thousand_peers_get_the_same_plan_in_any_order_within_a_bounded_search():
    model, peers = _big_mesh(1000, 3)
    got = plan(model, peers, context_tokens=4096)
    assert 2 <= len(got.stages) <= MAX_STAGES
    for seed in (1, 2):
        shuffled = peers[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(model, shuffled, context_tokens=4096) == got
    by_id = {p.peer_id: p for p in peers}
    for s in got.stages:
        p = by_id[s.peer_id]
        assert p.needs(model, s.start, s.end, 4096) <= usable(p, 0.1)
    # Its candidates were the whole mesh, not the few with the most memory x speed: the
    # search's budget of exact cuts bounds its work (and so its time) at any size.
    search = Search(model, peers, context_tokens=4096, headroom=0.1, unknown_rtt=70.0)
    assert len(search.pool) == len(peers)
    search.options()
    assert search.work <= MAX_WORK + MAX_STAGES


def test_a_model_that_needs_more_stages_than_a_split_may_have_is_not_planned():
    # 80 layers of 520 MB over peers that each hold two: forty stages would be needed.
    model, peers = _big_mesh(60, 5)
    small = [PeerCapacity(p.peer_id, int(1.3 * GB), p.speed, p.rtt_ms) for p in peers]
    search = Search(model, small, context_tokens=4096, headroom=0.1, unknown_rtt=70.0)
    assert search.options() == []
    with pytest.raises(PlanError, match=r"needs at least \d+ stages on these peers .* at most 32"):
        plan(model, small, context_tokens=4096)
