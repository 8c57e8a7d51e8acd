"""Several chains of one split (throughput by whole pipelines, as a model served whole gets
replicas): how the planner keeps, repairs and adds them, how claims carry them, when a split
of several is routable, and how the assignment grows and shrinks them with demand."""

from __future__ import annotations

import itertools

import pytest

from meshagent.placement.assignment import assign
from meshagent.placement.costs import MAX_CHAINS, decode_work, streams_gain
from meshagent.placement.demand import BUCKET_S, Bucket, Demand, bucket_of
from meshagent.placement.negotiation import (
    Claim,
    ClaimError,
    plan_digest,
    plan_in_force,
    routable,
    serving_chains,
)
from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    Plan,
    StageAssignment,
    is_repair,
    plan,
    should_replan,
)

GB = 1_000_000_000
CTX = 1000
NOW = 1_800_000_000.0
BIG = ModelCost("big", 30, (GB // 10,) * 30, 0, 0, 0, 0)  # 3 GB of layers: no peer holds it


def peers(n: int, gb: float = 1.7, speed: float = 100.0) -> list[PeerCapacity]:
    return [PeerCapacity(f"p{i:02}", int(gb * GB), speed) for i in range(n)]


def hosts(chain) -> set[str]:
    return {s.peer_id for s in chain}


def test_chains_are_whole_splits_over_peers_of_their_own():
    mesh = peers(8)
    one = plan(BIG, mesh, context_tokens=CTX)
    three = plan(BIG, mesh, context_tokens=CTX, chains=3)
    assert one.split and not one.chains
    assert len(three.pipelines) == 3 and three.stages == three.pipelines[0]
    for chain in three.pipelines:
        assert chain[0].start == 0 and chain[-1].end == BIG.n_layers
        assert all(a.end == b.start for a, b in itertools.pairwise(chain))
    every = [s.peer_id for c in three.pipelines for s in c]
    assert len(every) == len(set(every)) == len(three.peers)
    # As many as the peers hold, no more: 8 peers of 1.7 GB hold two 2-stage chains... of 3 GB
    many = plan(BIG, mesh, context_tokens=CTX, chains=10)
    assert len(many.pipelines) == len(mesh) // len(one.stages)
    # A peer sees the chain it is in, as a plan of one chain.
    second = three.chains[0]
    view = three.chain_of(second[1].peer_id)
    assert view.stages == second and not view.chains
    assert three.chain_of(three.stages[0].peer_id).stages == three.stages


def test_working_chains_stay_as_they_are_a_broken_one_is_repaired_or_dropped():
    mesh = peers(7)
    two = plan(BIG, mesh[:6], context_tokens=CTX, chains=2)
    assert len(two.pipelines) == 2
    # A faster peer comes: the working chains stay exactly (they serve meanwhile).
    fast = [*mesh[:6], PeerCapacity("fast", int(1.7 * GB), 1000.0)]
    again = plan(BIG, fast, context_tokens=CTX, chains=2, current=two)
    assert again.pipelines == two.pipelines
    # A chain's peer is gone: a spare takes its stage, nothing else moves.
    lost = two.chains[0][0].peer_id
    left = [p for p in mesh if p.peer_id != lost]
    repaired = plan(BIG, left, context_tokens=CTX, chains=2, current=two)
    assert repaired.stages == two.stages and is_repair(two, repaired)
    (spare,) = hosts(repaired.chains[0]) - hosts(two.chains[0])
    assert spare not in two.peers and lost not in repaired.peers
    # No spare: that chain goes, the other serves on.
    alone = plan(BIG, [p for p in left if p.peer_id in two.peers], context_tokens=CTX,
                 chains=2, current=two)  # fmt: skip
    assert alone.pipelines == (two.stages,)
    # The first chain lost instead: the second leads, as it was.
    first = two.stages[0].peer_id
    led = plan(
        BIG, [p for p in mesh[:6] if p.peer_id != first], context_tokens=CTX, chains=1, current=two
    )
    assert led.pipelines == (two.chains[0],)


def test_a_chain_added_or_dropped_is_followed_without_a_gain_threshold():
    mesh = peers(6)
    one = plan(BIG, mesh, context_tokens=CTX)
    two = plan(BIG, mesh, context_tokens=CTX, chains=2, current=one)
    assert two.stages == one.stages  # the serving chain stays; one more beside it
    assert should_replan(BIG, one, two, mesh)
    assert should_replan(BIG, two, one, mesh)
    assert plan_digest(two) != plan_digest(one)
    # A plan of one chain keeps the digest it had before chains existed.
    assert plan_digest(one) == plan_digest(Plan(one.model_id, CTX, stages=one.stages))


def split(*chains: tuple[str, ...]) -> Plan:
    def stages(names):
        return tuple(StageAssignment(p, 10 * i, 10 * (i + 1)) for i, p in enumerate(names))

    first, *rest = chains
    return Plan("m", 1000, stages=stages(first), chains=tuple(stages(c) for c in rest))


def test_claims_carry_chains_and_refuse_bad_ones():
    c = Claim("m", 7, "p", split(("a", "b"), ("c", "d")), True)
    assert Claim.from_cbor(c.to_cbor(), n_layers=20) == c
    base = c.to_cbor()
    bad = [
        {**base, 9: [[["a", 0, 10], ["e", 10, 20]]]},  # a peer in two chains
        {**base, 9: [[["e", 0, 10]]]},  # a chain that stops short of the last layer
        {**base, 9: [[]]},  # an empty chain
        {**base, 9: "x"},
        {**base, 5: ["a"], 6: [], 9: [[["e", 0, 20]]]},  # chains of a model served whole
        {**base, 9: [[[f"x{i}", 0, 20]] for i in range(300)]},  # too many peers in all
    ]
    for d in bad:
        with pytest.raises(ClaimError):
            Claim.from_cbor(d, n_layers=20)


def test_a_split_of_several_chains_routes_while_any_chain_serves():
    p = split(("a", "b"), ("c", "d"))
    claims = {x: Claim("m", 4, "a", p, True) for x in "abcd"}
    winner = plan_in_force(claims)
    assert serving_chains(winner, claims, set("abcd")) == p.pipelines
    # c is gone: the first chain serves on alone.
    assert serving_chains(winner, claims, set("abd")) == (p.stages,)
    assert routable(winner, claims, set("abd"))
    loading = {**claims, "a": Claim("m", 4, "a", p, False)}
    assert serving_chains(winner, loading, set("abd")) == ()
    assert not routable(winner, loading, set("abd"))


def steady(rate: float) -> Demand:
    b = bucket_of(NOW)
    return Demand(
        tuple(Bucket(i, 1, int(rate * BUCKET_S)) for i in range(b - 10, b)), NOW, NOW + 300, 0
    )


def chains_for(rate: float, mesh, current=None, streams: int = 1) -> Plan:
    a = assign({"big": BIG}, mesh, {"big": steady(rate)}, now=NOW, context_tokens=CTX,
               current={"big": current} if current else None, streams=streams)  # fmt: skip
    placed = a.get("big")
    assert placed is not None, a.reason("big")
    assert placed.chains == len(placed.plan.pipelines)
    return placed.plan


def test_the_assignment_grows_chains_with_demand_and_shrinks_them_when_it_settles_low():
    mesh = peers(9)
    low = chains_for(0.5, mesh)
    rate = 1000.0 / low.est_token_ms  # what one chain serves, a stream at a time
    assert len(low.pipelines) == 1
    assert len(chains_for(0.9 * rate, mesh, low).pipelines) == 1  # under one chain: no more
    high = chains_for(1.5 * rate, mesh, low)
    assert len(high.pipelines) == 3  # in one go: until they serve it at under half
    assert high.stages == low.stages  # the chain serving stays
    # Settled low again: back to one chain, the first.
    back = chains_for(0.1 * rate, mesh, high)
    assert back.pipelines == (low.stages,)


def test_extra_chains_give_way_to_a_model_a_request_waits_for():
    mesh = peers(6)
    busy = chains_for(100.0, mesh)
    assert len(busy.pipelines) == 3
    small = ModelCost("small", 10, (GB // 10,) * 10, 0, 0, 0, 0)  # 1 GB: fits a peer whole
    waits = Demand((), NOW, NOW + 300, 1)  # a request waits for it now
    a = assign({"big": BIG, "small": small}, mesh, {"big": steady(100.0), "small": waits},
               now=NOW, context_tokens=CTX, current={"big": busy})  # fmt: skip
    assert a.get("small") is not None, a.reason("small")
    kept = a.get("big")
    assert kept is not None and kept.plan.stages == busy.stages
    assert len(kept.plan.pipelines) == 2


def test_a_pinned_split_keeps_the_chains_asked_for_where_memory_holds_them():
    mesh = peers(9)

    def chains(asked: int, pins=frozenset({"big"}), mesh=mesh) -> int:
        a = assign({"big": BIG}, mesh, {}, now=NOW, context_tokens=CTX, pins=pins,
                   chains={"big": asked})  # fmt: skip
        placed = a.get("big")
        return 0 if placed is None else len(placed.plan.pipelines)

    assert chains(1) == 2  # no demand: one, and a standby
    assert chains(1, mesh=mesh[:3]) == 1  # (where the memory holds one)
    assert chains(3) == 3
    assert chains(16) == len(mesh) // len(plan(BIG, mesh, context_tokens=CTX).stages)
    assert chains(3, mesh=mesh[:5]) == 2  # as many as the memory holds
    assert chains(3, pins=frozenset()) == 0  # (not pinned, not asked for: not placed)


def test_a_chain_counts_the_streams_it_decodes_together():
    mesh = peers(9)
    low = chains_for(0.5, mesh)
    rate = 1000.0 / low.est_token_ms  # what one chain serves, a stream at a time
    assert len(chains_for(1.5 * rate, mesh, low).pipelines) == 3
    # Four streams together serve 4 / 1.3 times one: this demand is still under one chain.
    assert streams_gain(4) == pytest.approx(4 / 1.3)
    assert len(chains_for(1.5 * rate, mesh, low, streams=4).pipelines) == 1
    assert len(chains_for(4.0 * rate, mesh, low, streams=4).pipelines) == 3


def test_demand_grows_chains_up_to_max_chains():
    mesh = peers(2 * MAX_CHAINS + 6)
    plan_ = chains_for(1e6, mesh)
    assert len(plan_.pipelines) == MAX_CHAINS
    every = [s.peer_id for c in plan_.pipelines for s in c]
    assert len(every) == len(set(every))


def test_prompt_tokens_count_at_their_prefill_cost():
    assert decode_work(0, 50) == 50
    assert decode_work(200, 128) == 128 + 20  # a prompt token: a tenth of a decoded one
    assert decode_work(1, 0) == 1  # (rounded up: any work counts)
