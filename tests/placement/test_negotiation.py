import random

import pytest

from meshagent.placement.negotiation import (
    Claim,
    ClaimError,
    next_epoch,
    plan_in_force,
    routable,
    serving_peers,
)
from meshagent.placement.planner import Plan, StageAssignment


def split(*peers: str) -> Plan:
    stages = tuple(StageAssignment(p, 10 * i, 10 * (i + 1)) for i, p in enumerate(peers))
    return Plan("m", 1000, stages=stages, est_token_ms=30.0)


def test_highest_epoch_wins_then_lowest_proposer():
    old = Claim("m", 1, "a", split("a", "b", "c"), True)
    newer = Claim("m", 2, "z", split("c", "b", "a"), False)
    rival = Claim("m", 2, "b", split("b", "a", "c"), False)
    claims = {"a": old, "z": newer, "b": rival}
    assert plan_in_force(claims) == rival
    # Every agent reaches the same answer whatever order it saw the claims in.
    items = list(claims.items())
    for _ in range(10):
        random.shuffle(items)
        assert plan_in_force(dict(items)) == rival
    assert next_epoch(claims) == 3


def test_routable_only_when_every_stage_follows_and_is_ready():
    plan = split("a", "b", "c")
    claims = {p: Claim("m", 4, "a", plan, True) for p in "abc"}
    winner = plan_in_force(claims)
    assert routable(winner, claims, alive={"a", "b", "c"})
    assert not routable(winner, claims, alive={"a", "b"})  # c is dead
    loading = {**claims, "c": Claim("m", 4, "a", plan, False)}
    assert not routable(winner, loading, alive=set("abc"))
    behind = {**claims, "b": Claim("m", 3, "a", split("b", "a", "c"), True)}
    assert not routable(plan_in_force(behind), behind, alive=set("abc"))


def test_a_whole_model_is_routable_while_any_replica_serves():
    plan = Plan("m", 1000, replicas=("a", "b"), est_token_ms=1.0)
    claims = {"a": Claim("m", 5, "a", plan, True), "b": Claim("m", 5, "a", plan, False)}
    winner = plan_in_force(claims)
    # b still loads its copy: a serves meanwhile, and only a is listed as serving.
    assert routable(winner, claims, alive={"a", "b"})
    assert serving_peers(winner, claims, alive={"a", "b"}) == ("a",)
    ready = {**claims, "b": Claim("m", 5, "a", plan, True)}
    assert serving_peers(winner, ready, alive={"a", "b"}) == ("a", "b")
    assert serving_peers(winner, ready, alive={"b"}) == ("b",)  # a is dead
    assert not routable(winner, ready, alive=set())


def test_claims_round_trip_and_refuse_garbage():
    c = Claim("m", 7, "p", split("a", "b"), True)
    assert Claim.from_cbor(c.to_cbor()) == c
    for bad in (None, {}, {0: 1}, {**c.to_cbor(), 6: [["a", "x", 1]]}, {**c.to_cbor(), 0: 9}):
        with pytest.raises(ClaimError):
            Claim.from_cbor(bad)
