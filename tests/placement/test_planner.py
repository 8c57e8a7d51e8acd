"""The planner, fed tables of peers."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    Plan,
    PlanError,
    StageAssignment,
    plan,
    should_replan,
)

MB = 1_000_000
GB = 1_000_000_000
CTX = 1000

MODEL = ModelCost(
    model_id="m",
    n_layers=30,
    layer_bytes=(100 * MB,) * 30,
    embedding_bytes=50 * MB,
    head_bytes=50 * MB,
    other_bytes=0,
    kv_bytes_per_token_per_layer=1000,  # 1 MB per layer at 1000 tokens
)
WHOLE = MODEL.stage_bytes(0, 30, CTX)  # 3.13 GB


def peer(pid: str, gb: float, speed: float = 100.0, **rtt: float) -> PeerCapacity:
    return PeerCapacity(pid, int(gb * GB), speed, rtt)


def check_fits(p, peers, headroom=0.1):
    by_id = {x.peer_id: x for x in peers}
    for s in p.stages:
        need = MODEL.stage_bytes(s.start, s.end, CTX)
        assert need <= by_id[s.peer_id].memory_bytes * (1 - headroom), s
    assert p.stages[0].start == 0
    assert p.stages[-1].end == MODEL.n_layers
    for a, b in zip(p.stages, p.stages[1:], strict=False):
        assert a.end == b.start


def test_a_model_that_fits_one_peer_is_never_split():
    peers = [peer("a", 4.0, speed=10), peer("b", 2.0, speed=500), peer("c", 2.0, speed=500)]
    p = plan(MODEL, peers, context_tokens=CTX)
    assert not p.split
    assert p.replicas == ("a",)


def test_every_peer_that_fits_is_a_replica_fastest_first():
    peers = [peer("a", 4.0, speed=10), peer("b", 5.0, speed=50), peer("c", 1.0)]
    assert plan(MODEL, peers, context_tokens=CTX).replicas == ("b", "a")


# One GFLOP per layer: a peer's speed in layers per second is its GFLOP/s.
FLOPPED = replace(MODEL, flops_per_layer=1e9)


def test_the_entrys_draft_model_counts_in_the_time_of_a_model_served_whole():
    # a: 30 layers at 100 a second, 300 ms a token, and a draft model of 6 GFLOP (6 layers'
    # worth): 360 ms; b: 315.8 ms with none. Without the draft a is faster.
    a, b = peer("a", 4.0, speed=100), peer("b", 4.0, speed=95)
    assert plan(FLOPPED, [a, b], context_tokens=CTX).replicas == ("a", "b")
    drafting = replace(a, draft_gflops=6.0)
    assert drafting.stage_ms(FLOPPED, 0, 30, CTX) == pytest.approx(360.0)
    assert drafting.stage_ms(FLOPPED, 10, 30, CTX) == pytest.approx(200.0)  # not the entry
    p = plan(FLOPPED, [drafting, b], context_tokens=CTX)
    assert p.replicas == ("b", "a") and p.est_token_ms == pytest.approx(1000 * 30 / 95)
    # A draft model that drafts only for bigger models (`auto`) costs this one nothing.
    above = replace(drafting, drafts_from_gflops=31.0)
    assert above.stage_ms(FLOPPED, 0, 30, CTX) == pytest.approx(300.0)
    assert plan(FLOPPED, [above, b], context_tokens=CTX).replicas == ("a", "b")
    # Without the model's FLOPs there is no unit to count it in.
    assert drafting.stage_ms(MODEL, 0, 30, CTX) == pytest.approx(300.0)


def test_a_split_puts_its_first_stage_on_the_peer_whose_draft_model_costs_less():
    # Neither holds the model alone; equal speeds. With a's draft model at 6 GFLOP a token
    # the entry goes to b, whose draft model is at 1.
    a = replace(peer("a", 2.0), draft_gflops=6.0)
    b = replace(peer("b", 2.0), draft_gflops=1.0)
    plain = plan(FLOPPED, [peer("a", 2.0), peer("b", 2.0)], context_tokens=CTX)
    assert plain.split and plain.stages[0].peer_id == "a"
    for peers in ([a, b], [b, a]):
        p = plan(FLOPPED, peers, context_tokens=CTX)
        assert p.split and p.stages[0].peer_id == "b", p
        check_fits(p, peers)
        # its time counts b's draft model, once: 1 GFLOP at 100 GFLOP/s
        assert p.est_token_ms - plain.est_token_ms == pytest.approx(10.0)


def test_a_model_that_may_not_be_split_is_served_whole_or_refused_with_the_reason():
    whole_only = replace(MODEL, split_refusal="split only once certified")
    assert plan(whole_only, [peer("a", 4.0), peer("b", 2.0)], context_tokens=CTX).replicas == ("a",)
    with pytest.raises(PlanError, match="cannot be split \\(split only once certified\\)"):
        plan(whole_only, [peer("a", 2.0), peer("b", 2.0)], context_tokens=CTX)
    assert plan(MODEL, [peer("a", 2.0), peer("b", 2.0)], context_tokens=CTX).split


def test_heterogeneous_memory_splits_into_the_fewest_stages_that_fit():
    # Usable (90%): a 2.7 GB, b 1.35, c 1.08, d 0.9; the model needs 3.13 GB: two suffice.
    peers = [peer("a", 3.0), peer("b", 1.5), peer("c", 1.2), peer("d", 1.0)]
    p = plan(MODEL, peers, context_tokens=CTX)
    assert p.split
    assert {s.peer_id for s in p.stages} == {"a", "b"}
    check_fits(p, peers)
    # Without a, three stages are needed.
    rest = peers[1:]
    p3 = plan(MODEL, rest, context_tokens=CTX)
    assert len(p3.stages) == 3
    check_fits(p3, rest)


def test_three_small_peers_must_all_be_used():
    peers = [peer("a", 1.3), peer("b", 1.3), peer("c", 1.3)]
    p = plan(MODEL, peers, context_tokens=CTX)
    assert [s.peer_id for s in p.stages] and len(p.stages) == 3
    check_fits(p, peers)
    assert sum(s.layers for s in p.stages) == 30


def test_a_faster_peer_takes_all_the_layers_its_memory_holds():
    # A token passes every stage in turn: the least time per token puts each layer on the
    # fastest peer that has room for it (`placement/cuts.py`).
    peers = [peer("fast", 5.0, speed=200), peer("slow", 5.0, speed=100)]
    # Each could hold the model alone with no headroom; force a split with a bigger context.
    big = ModelCost(**{**MODEL.__dict__, "kv_bytes_per_token_per_layer": 60_000})
    p = plan(big, peers, context_tokens=CTX)
    layers = {s.peer_id: s.layers for s in p.stages}
    fast = next(s for s in p.stages if s.peer_id == "fast")
    room = peers[0].memory_bytes * 0.9
    assert big.stage_bytes(fast.start, fast.end, CTX) <= room
    # one layer more would not fit there
    more = (fast.start, fast.end + 1) if fast.start == 0 else (fast.start - 1, fast.end)
    assert big.stage_bytes(*more, CTX) > room
    assert layers["fast"] > layers["slow"] and sum(layers.values()) == 30
    # Equal peers share equally.
    even = plan(big, [peer("a", 5.0), peer("b", 5.0)], context_tokens=CTX)
    assert [s.layers for s in even.stages] == [15, 15]


def test_speed_share_is_capped_by_memory():
    peers = [peer("fast", 1.2, speed=1000), peer("slow", 3.0, speed=100)]
    p = plan(MODEL, [*peers], context_tokens=CTX)
    check_fits(p, peers)
    layers = {s.peer_id: s.layers for s in p.stages}
    assert layers["fast"] < 20 < layers["fast"] + layers["slow"]


def test_stage_order_keeps_the_ring_short():
    # a-b and b-c are close, a-c is far: with 3 stages any ring uses all 3 links, but the
    # entry (which holds the embeddings) and the exit differ in memory need; check determinism
    # and that two stages pick the nearby pair when either pair would fit.
    peers = [
        peer("a", 1.8, b=1.0, c=80.0),
        peer("b", 1.8, a=1.0, c=80.0),
        peer("c", 1.8, a=80.0, b=80.0),
    ]
    p = plan(MODEL, peers, context_tokens=CTX)
    assert {s.peer_id for s in p.stages} == {"a", "b"}


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.5, 4.0), st.floats(10, 400)), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_shuffled_snapshots_give_identical_plans(specs, rnd):
    peers = [peer(f"p{i}", gb, speed) for i, (gb, speed) in enumerate(specs)]
    shuffled = peers[:]
    rnd.shuffle(shuffled)
    try:
        expected = plan(MODEL, peers, context_tokens=CTX)
    except PlanError as e:
        with pytest.raises(PlanError) as again:
            plan(MODEL, shuffled, context_tokens=CTX)
        assert str(again.value) == str(e)
        return
    assert plan(MODEL, shuffled, context_tokens=CTX) == expected
    if expected.split:
        check_fits(expected, peers)


def test_too_little_memory_says_how_much_is_missing():
    with pytest.raises(PlanError, match=r"needs \d+\.\d+ GB more memory"):
        plan(MODEL, [peer("a", 1.0), peer("b", 1.0)], context_tokens=CTX)
    with pytest.raises(PlanError, match="empty"):
        plan(MODEL, [], context_tokens=CTX)


def test_no_replan_for_a_small_gain_but_replan_when_broken_or_much_better():
    peers = [peer("a", 1.3, speed=100), peer("b", 1.3, speed=100), peer("c", 1.3, speed=100)]
    current = plan(MODEL, peers, context_tokens=CTX)
    # A fourth peer, a little faster than the others, joins: not worth moving layers.
    joined = [*peers, peer("d", 1.3, speed=110)]
    candidate = plan(MODEL, joined, context_tokens=CTX)
    assert not should_replan(MODEL, current, candidate, joined)
    # A peer that can host the model whole and is much faster: worth it.
    big = [*peers, peer("e", 8.0, speed=400)]
    assert should_replan(MODEL, current, plan(MODEL, big, context_tokens=CTX), big)
    # A stage's peer left: the current plan is broken, any working plan replaces it.
    left = [p for p in joined if p.peer_id != current.stages[1].peer_id]
    assert should_replan(MODEL, current, plan(MODEL, left, context_tokens=CTX), left)


def test_many_peers_plan_quickly():
    rng = random.Random(1)
    peers = [peer(f"p{i:02}", rng.uniform(0.6, 1.2), rng.uniform(50, 200)) for i in range(20)]
    p = plan(MODEL, peers, context_tokens=CTX)
    check_fits(p, peers)


def test_a_split_that_lost_a_peer_is_repaired_with_a_spare_keeping_the_others_parts():
    three = [peer("a", 1.3), peer("b", 1.3), peer("c", 1.3)]
    before = plan(MODEL, three, context_tokens=CTX)
    assert len(before.stages) == 3
    lost = before.stages[1].peer_id
    left = [p for p in three if p.peer_id != lost] + [peer("spare", 1.3, speed=50.0)]
    after = plan(MODEL, left, context_tokens=CTX, current=before)
    assert [(s.start, s.end) for s in after.stages] == [(s.start, s.end) for s in before.stages]
    assert [s.peer_id for s in after.stages] == [
        "spare" if s.peer_id == lost else s.peer_id for s in before.stages
    ]
    check_fits(after, left)
    # Unbroken, the plan in force is not "repaired"; a spare too small for the lost part
    # leaves the choice to the full search.
    assert plan(MODEL, three, context_tokens=CTX, current=before) == before
    tiny = [p for p in three if p.peer_id != lost] + [peer("spare", 0.2), peer("big", 4.0)]
    fresh = plan(MODEL, tiny, context_tokens=CTX, current=before)
    assert fresh.replicas == ("big",)
    small = [p for p in three if p.peer_id != lost] + [peer("spare", 0.2)]
    with pytest.raises(PlanError):
        plan(MODEL, small, context_tokens=CTX, current=before)


def test_a_gain_of_a_few_milliseconds_moves_nothing():
    # A small model on fast peers: most of the estimate is RTT, which swings by milliseconds
    # on its own. Links measured at 3 ms, then at 1.5 ms: the same split looks 40% faster,
    # but by 4 ms a token, which is not worth stopping the split to move layers.
    def mesh(rtt: float) -> list[PeerCapacity]:
        ids = ("a", "b", "c")
        return [peer(i, 1.3, 30_000, **{j: rtt for j in ids if j != i}) for i in ids]

    current = plan(MODEL, mesh(3.0), context_tokens=CTX)
    candidate = replace(plan(MODEL, mesh(1.5), context_tokens=CTX), stages=current.stages[::-1])
    assert candidate.est_token_ms * 1.25 < current.est_token_ms
    assert current.est_token_ms - candidate.est_token_ms < 5
    assert not should_replan(MODEL, current, candidate, mesh(3.0))
    assert should_replan(MODEL, current, replace(candidate, est_token_ms=1.0), mesh(30.0))


def test_a_peer_that_has_not_measured_its_rtts_does_not_look_closer():
    # A WAN split of a small model (fast peers: the estimate is mostly RTT) whose pairs
    # measured 30 ms; a spare restarts and has measured nothing yet. Unknown pairs count as
    # the farthest measured one, so the spare draws no split to it before its probes say
    # where it is.
    ms, fast = 30.0, 3000.0

    def mesh(d_rtt: float | None) -> list[PeerCapacity]:
        out = []
        for pid in "abc":
            rtts = {o: ms for o in "abc" if o != pid}
            if d_rtt is not None:
                rtts["d"] = d_rtt
            out.append(peer(pid, 1.3, speed=fast, **rtts))
        d = {o: d_rtt for o in "abc"} if d_rtt is not None else {}
        return [*out, peer("d", 1.3, speed=fast * 1.05, **d)]

    three = mesh(None)[:3]
    current = plan(MODEL, three, context_tokens=CTX)
    assert current.est_token_ms >= 3 * ms
    restarted = mesh(None)
    assert not should_replan(MODEL, current, plan(MODEL, restarted, context_tokens=CTX), restarted)
    # Measured, and much nearer than the rest: now it is worth moving.
    near = mesh(1.0)
    better = plan(MODEL, near, context_tokens=CTX)
    assert "d" in better.peers and should_replan(MODEL, current, better, near)


def test_a_new_split_keeps_the_entry_unless_another_is_much_faster():
    # The split loses a stage that no spare can hold (20 layers): the peers left are split
    # anew, and the entry (where the clients' requests are) stays where it was.
    peers = [peer(p, 1.3, speed=100.0) for p in ("b", "c", "d", "e")]
    current = Plan(
        "m", CTX, stages=(StageAssignment("e", 0, 5), StageAssignment("x", 5, 25),
                          StageAssignment("b", 25, 30)),
    )  # fmt: skip
    after = plan(MODEL, peers, context_tokens=CTX, current=current)
    assert after.stages[0].peer_id == "e"
    alone = plan(MODEL, peers, context_tokens=CTX)
    assert alone.stages[0].peer_id == "b"  # without a current plan: the smallest order
    # An entry much slower than the others gives way: even the one layer it would keep costs
    # more than `KEEP_ENTRY`.
    slow = [*peers[:3], peer("e", 1.3, speed=2.0)]
    assert plan(MODEL, slow, context_tokens=CTX, current=current).stages[0].peer_id != "e"


def test_a_working_split_moves_its_entry_only_for_a_much_faster_plan():
    # The entry holds the requests in flight: a plan entered elsewhere must be twice as fast
    # to replace a working split; one that keeps the entry needs the usual 25%.
    peers = [peer(p, 1.3, speed=100.0) for p in "abcd"]
    current = Plan(
        "m", CTX, stages=(StageAssignment("a", 0, 10), StageAssignment("b", 10, 20),
                          StageAssignment("c", 20, 30)),
        est_token_ms=300.0,
    )  # fmt: skip
    now = 300.0  # 30 layers at 100 layers/s, the RTTs unmeasured count as 5 ms each
    moved = Plan("m", CTX, stages=(StageAssignment("d", 0, 15), StageAssignment("b", 15, 30)))

    def faster(plan: Plan, by: float) -> Plan:
        return replace(plan, est_token_ms=now / by)

    assert not should_replan(MODEL, current, faster(moved, 1.6), peers)
    assert should_replan(MODEL, current, faster(moved, 2.5), peers)
    kept = replace(moved, stages=(StageAssignment("a", 0, 15), StageAssignment("d", 15, 30)))
    assert should_replan(MODEL, current, faster(kept, 1.6), peers)


def test_replicas_are_added_and_dropped_without_a_gain_threshold():
    one = [peer("a", 4.0)]
    current = plan(MODEL, one, context_tokens=CTX)
    assert current.replicas == ("a",)
    # Another peer that fits joins: the same speed per token, but one more replica, and
    # the one serving stays.
    two = [*one, peer("b", 4.0)]
    grown = plan(MODEL, two, context_tokens=CTX, current=current)
    assert set(grown.replicas) == {"a", "b"}
    assert should_replan(MODEL, current, grown, two)
    assert not should_replan(MODEL, grown, plan(MODEL, two, context_tokens=CTX), two)
    # b is gone: the plan follows the replica that is left.
    assert should_replan(MODEL, grown, plan(MODEL, one, context_tokens=CTX), one)


def _holding(p: PeerCapacity, *ranges: tuple[int, int], whole: bool = False) -> PeerCapacity:
    return replace(p, whole_file=whole, holds=frozenset(ranges))


def test_among_close_splits_the_peers_holding_the_file_or_slices_are_preferred():
    # Four equal peers, three needed. None holding anything: the plan by peer id.
    four = [_holding(peer(x, 1.3)) for x in "abcd"]
    none = plan(MODEL, four, context_tokens=CTX)
    assert {s.peer_id for s in none.stages} == {"a", "b", "c"}
    # "d" holds the whole file: a plan as fast that uses it downloads a stage less.
    with_d = [*four[:3], _holding(four[3], whole=True)]
    chosen = plan(MODEL, with_d, context_tokens=CTX)
    assert "d" in {s.peer_id for s in chosen.stages}
    assert chosen.est_token_ms <= none.est_token_ms * 1.10
    # "d" holds exactly the slice the plan by id gives "c": it takes that slice.
    c_stage = next(s for s in none.stages if s.peer_id == "c")
    sliced = [*four[:3], _holding(four[3], (c_stage.start, c_stage.end))]
    took = plan(MODEL, sliced, context_tokens=CTX)
    assert StageAssignment("d", c_stage.start, c_stage.end) in took.stages
    # A holder much slower than the rest is not worth the plan's speed.
    slow = [*four[:3], _holding(peer("d", 1.3, speed=40.0), whole=True)]
    assert "d" not in {s.peer_id for s in plan(MODEL, slow, context_tokens=CTX).stages}
    # Every peer holding the file (a LAN of local copies): exactly the plan as before.
    every = [_holding(p, whole=True) for p in four]
    assert plan(MODEL, every, context_tokens=CTX) == plan(
        MODEL, [peer(x, 1.3) for x in "abcd"], context_tokens=CTX
    )


def test_a_peer_that_read_the_tokenizer_takes_an_end_stage_among_close_splits():
    """Stage hosts that fetched the header around the tokenizer must fetch it for the first
    or the last stage; the one that read it (the first to start) takes one of those."""
    model = replace(MODEL, tokenizer_bytes=2 * MB)
    three = [_holding(peer(x, 1.3)) for x in "abc"]
    by_id = plan(model, three, context_tokens=CTX)
    middle = by_id.stages[1].peer_id
    # Every peer but the middle one of the plan by id lacks the tokenizer.
    lacking = [p if p.peer_id == middle else replace(p, tokenizer=False) for p in three]
    chosen = plan(model, lacking, context_tokens=CTX)
    assert chosen.stages[1].peer_id != middle
    assert chosen.est_token_ms <= by_id.est_token_ms * 1.10
    assert lacking[0].download_bytes(model, 10, 20) == model.weight_bytes(10, 20)
    ends = next(p for p in lacking if not p.tokenizer)
    assert ends.download_bytes(model, 0, 10) == model.weight_bytes(0, 10) + 2 * MB
    # No one lacking it: the plan by id, as before.
    assert plan(model, three, context_tokens=CTX) == by_id


def test_a_repair_gives_a_lost_stage_to_a_spare_that_holds_it():
    three = [_holding(peer(x, 1.3)) for x in "abc"]
    before = plan(MODEL, three, context_tokens=CTX)
    lost = before.stages[1]
    left = [p for p in three if p.peer_id != lost.peer_id]
    spares = [_holding(peer("s1", 1.3)), _holding(peer("s2", 1.3), (lost.start, lost.end))]
    after = plan(MODEL, left + spares, context_tokens=CTX, current=before)
    assert after.stages[1] == StageAssignment("s2", lost.start, lost.end)


def test_a_repair_prefers_a_slower_spare_holding_the_stage_to_a_faster_one_that_must_fetch_it():
    # Requests in flight wait for the repair: a download of a big stage outlasts them.
    three = [_holding(peer(x, 1.3)) for x in "abc"]
    before = plan(MODEL, three, context_tokens=CTX)
    lost = before.stages[1]
    left = [p for p in three if p.peer_id != lost.peer_id]
    fast, slow = peer("fast", 1.3, speed=400.0), peer("slow", 1.3, speed=50.0)
    spares = [_holding(fast), _holding(slow, (lost.start, lost.end))]
    after = plan(MODEL, left + spares, context_tokens=CTX, current=before)
    assert after.stages[1] == StageAssignment("slow", lost.start, lost.end)
    lacking = plan(MODEL, [*left, _holding(fast)], context_tokens=CTX, current=before)
    assert lacking.stages[1].peer_id == "fast"  # none holds it: the fastest downloads it


def test_a_working_split_is_not_left_for_one_that_must_download_a_stage_first():
    # A much faster split on new peers: taken where they hold the file, not where one must
    # download its stage first (the split would stop serving for the download).
    slow = [peer(x, 1.3, speed=100) for x in "abc"]
    current = plan(MODEL, slow, context_tokens=CTX)
    fast = [peer(x, 1.3, speed=400) for x in "xyz"]
    held = [*slow, *fast]
    candidate = plan(MODEL, held, context_tokens=CTX)
    assert set(candidate.peers) <= {"x", "y", "z"}
    assert should_replan(MODEL, current, candidate, held)
    lacking = [*slow, *fast[:2], _holding(fast[2])]
    assert not should_replan(MODEL, current, candidate, lacking)
    # broken, it is left for whatever works
    gone = [p for p in lacking if p.peer_id != current.stages[0].peer_id]
    assert should_replan(MODEL, current, candidate, gone)


def test_a_split_whose_remaining_stage_no_longer_fits_is_planned_afresh_not_repaired():
    # c is gone and b's offer shrank below its stage (another model took memory there, say):
    # giving c's stage to a spare would leave b's stage where it no longer fits.
    three = [peer(x, 1.3) for x in "abc"]
    before = plan(MODEL, three, context_tokens=CTX)
    b = before.stages[1].peer_id
    gone = before.stages[2].peer_id
    left = [peer(p.peer_id, 0.3) if p.peer_id == b else p for p in three if p.peer_id != gone]
    spares = [peer("s1", 1.3), peer("s2", 1.3)]
    after = plan(MODEL, left + spares, context_tokens=CTX, current=before)
    check_fits(after, left + spares)
