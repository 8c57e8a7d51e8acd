"""The scale simulation (`meshagent/testing/scale_sim.py`) on a small mesh: agents on the signed
SWIM bus agree on splits of three 70B-shaped models from their own views, serve requests, and
when an agent serving a stage crashes, the split is repaired within the replay deadline and
the requests it was serving replay and finish. Who claims a plan decides what a plan change
costs in records."""

from __future__ import annotations

import pytest

from meshagent.testing.scale_sim import REPLAY_DEADLINE_S, ScaleSim
from meshagent.testing.scale_tokens import prompt_of, reference


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
    # No demand yet: each pinned split one chain, and a standby where memory holds one.
    formed_with = {m: len(sim.chains_of(m)) for m in sim.force[0]}
    assert all(1 <= n <= 2 for n in formed_with.values()) and 2 in formed_with.values()
    sim.set_load(1.5)
    start = sim.bus.now
    while sim.bus.now < start + 60:
        sim.step(start)
    # Demand past what one chain serves with every slot busy: more chains, on spare memory.
    grown = {m: len(sim.chains_of(m)) for m in sim.force[0]}
    assert any(grown[m] > formed_with[m] for m in grown), (formed_with, grown)

    def running(model: str, chain) -> list:
        return [r for r in sim.requests if r.chain == chain and r.finished is None]

    model, chain = max(
        ((m, c) for m in sorted(sim.force[0]) for c in sim.chains_of(m)),
        key=lambda mc: len(running(*mc)),
    )
    force, busy = sim.force[0][model], running(model, chain)
    # the chain's stage of fewest layers: a spare can take it over (a repair)
    victim = min(chain, key=lambda s: (s[2] - s[1], s[0]))[0]
    rest = {s for s in chain if s[0] != victim}

    def mended() -> bool:  # the chain, its lost stage on a spare, serves again
        return any(rest < set(c) for c in sim.chains(model, 0))

    crashed = sim.bus.now
    sim.crash(victim)
    while victim in sim.force[0][model].plan.peers or not mended() or sim.bus.now < crashed + 1:
        assert sim.bus.now < crashed + REPLAY_DEADLINE_S, "not repaired in time"
        sim.step(start)
    repaired = sim.force[0][model]
    assert repaired.repair
    # the other stages stay as they were, every chain's; one peer takes the lost stage's layers
    before = [s for c in force.plan.pipelines for s in c]
    after = [s for c in repaired.plan.pipelines for s in c]
    assert len(after) == len(before) and sum(s not in before for s in after) == 1
    while any(r.finished is None and not r.failed for r in busy):
        assert sim.bus.now < crashed + 900
        sim.step(None)
    assert busy, "no request was on the chain when its stage crashed"
    for r in busy:
        assert r.finished is not None and r.replays >= 1 and not r.failed, r
        # decoded on fake splits, part on the chain lost and part on the one it replayed on:
        # exactly the whole model's text
        assert r.tokens == reference(prompt_of(r.rid, r.prompt), r.output)
    served = [r for r in sim.requests if r.finished is not None]
    assert served and all(
        r.tokens == reference(prompt_of(r.rid, r.prompt), r.output) for r in served
    )
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
