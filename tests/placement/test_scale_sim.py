"""The scale simulation (`meshagent/testing/scale_sim.py`) on a small mesh: agents on the signed
SWIM bus agree on splits of three 70B-shaped models from their own views, serve requests, and
when an agent serving a stage crashes, the split is repaired within the replay deadline and
the requests it was serving replay and finish. Who claims a plan decides what a plan change
costs in records."""

from __future__ import annotations

import pytest

from meshagent.testing.scale_sim import REPLAY_DEADLINE_S, ScaleSim


def _formed(claims_by: str) -> ScaleSim:
    sim = ScaleSim(40, seed=5, claims_by=claims_by)
    sim.settle_coordinates()
    everyone = set(sim.names)
    while not sim.bus.views_complete(everyone):
        sim.bus.run_until(sim.bus.now + 0.5)
    while not sim.all_routable():
        assert sim.bus.now < 400, "no plan for every model within 400 s"
        sim.step(None)
    return sim


@pytest.fixture(scope="module")
def formed() -> ScaleSim:
    return _formed("plan")


def test_a_stage_lost_is_repaired_within_the_replay_deadline_and_its_requests_replay(formed):
    sim = formed
    assert sim.tally.disagreements == 0 and sim.tally.order_checks >= 1
    assert all(len(f.plan.stages) >= 2 for f in sim.force[0].values())  # 70B: split
    sim.set_load(0.5)
    start = sim.bus.now
    while sim.bus.now < start + 60:
        sim.step(start)

    def running(model: str) -> list:
        key = sim.force[0][model].key
        return [r for r in sim.requests if r.chain == key and r.finished is None]

    model = max(sorted(sim.force[0]), key=lambda m: len(running(m)))
    force, busy = sim.force[0][model], running(model)
    # the stage of fewest layers: a spare can take it over (a repair)
    victim = min(force.plan.stages, key=lambda s: (s.end - s.start, s.peer_id)).peer_id
    crashed = sim.bus.now
    sim.crash(victim)
    while sim.routable(model, 0) is None or sim.bus.now < crashed + 1:
        assert sim.bus.now < crashed + REPLAY_DEADLINE_S, "not routable again in time"
        sim.step(start)
    repaired = sim.force[0][model]
    assert repaired.repair and victim not in repaired.plan.peers
    # the other stages stay as they were; one peer takes the lost stage's layers
    assert sum(s not in force.plan.stages for s in repaired.plan.stages) == 1
    while any(r.finished is None and not r.failed for r in busy):
        assert sim.bus.now < crashed + 900
        sim.step(None)
    assert busy, "no request was on the chain when its stage crashed"
    for r in busy:
        assert r.finished is not None and r.replays >= 1 and not r.failed, r
    # nothing else failed, but what was asked at the crashed agent itself
    assert {r.failed for r in sim.requests if r.failed} <= {"its client's own agent stopped"}


def test_only_a_plans_peers_and_its_proposer_claim_it():
    # Every agent claiming every plan republishes each agent's record per plan change;
    # the plan's peers and its proposer, a few records.
    few, every = _formed("plan"), _formed("all")
    claimants = {p for f in few.force[0].values() for p in (*f.plan.peers, f.proposer)}
    assert set(few.claims) <= claimants
    assert few.tally.republished <= 2 * len(claimants) * len(few.force[0])
    assert set(every.claims) == set(every.names)
    assert every.tally.republished >= 2 * len(every.names)
