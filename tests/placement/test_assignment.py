"""The assignment of peers to models, fed tables: who is wanted, in what order, what stays
where it is, what gives way, and that every agent computes the same."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.placement.assignment import Assignment, assign, restrict
from meshagent.placement.demand import BUCKET_S, Bucket, Demand, DemandMeter, bucket_of
from meshagent.placement.planner import ModelCost, PeerCapacity, Plan, plan
from meshagent.placement.shares import replica_share

GB = 1_000_000_000
CTX = 1000
NOW = 1_800_000_000.0


def model(mid: str, gb: float, layers: int = 10) -> ModelCost:
    """A model of `gb` GB of layers; at 100 layers/s a replica serves 10 tokens/s."""
    return ModelCost(mid, layers, (int(gb * GB) // layers,) * layers, 0, 0, 0, 0)


def peer(pid: str, gb: float, speed: float = 100.0, **kw) -> PeerCapacity:
    return PeerCapacity(pid, int(gb * GB), speed, **kw)


def steady(rate: float, *, last_used: float = NOW, keep_alive: float = 300.0) -> Demand:
    """`rate` tokens per second for the last ten minutes, the last request at `last_used`."""
    b = bucket_of(NOW)
    buckets = tuple(Bucket(i, 1, int(rate * BUCKET_S)) for i in range(b - 10, b))
    return Demand(buckets, last_used, last_used + keep_alive, 0)


def run(models, peers, demand, **kw) -> Assignment:
    kw.setdefault("now", NOW)
    kw.setdefault("context_tokens", CTX)
    return assign({m.model_id: m for m in models}, peers, demand, **kw)


def peers_of(a: Assignment, m: str) -> tuple[str, ...]:
    placed = a.get(m)
    assert placed is not None, a.reason(m)
    return placed.plan.peers


def check_shares_fit(a: Assignment, peers: list[PeerCapacity]) -> None:
    """The shares each peer gives add up to no more than it offers, and each model's plan
    runs on its shares."""
    offers = {p.peer_id: p for p in peers}
    used: dict[str, list[int]] = {}
    for placed in a.placed:
        for c in placed.peers:
            u = used.setdefault(c.peer_id, [0, 0, 0])
            u[0] += c.memory_bytes
            u[1] += c.vram_bytes
            u[2] += c.spare_bytes
        assert set(placed.plan.peers) <= set(placed.peer_ids)
    for pid, (memory, vram, spare) in used.items():
        p = offers[pid]
        assert memory <= p.memory_bytes and vram <= p.vram_bytes and spare <= p.spare_bytes


def test_a_model_nobody_asked_for_is_not_placed_unless_pinned():
    models = [model("a", 1), model("b", 1)]
    a = run(models, [peer("p", 4)], {})
    assert a.placed == ()
    assert "not requested" in a.reason("a")
    pinned = run(models, [peer("p", 4)], {}, pins=frozenset({"b"}))
    assert peers_of(pinned, "b") == ("p",)
    assert pinned.get("a") is None


def test_keep_alive_default_zero_and_never_as_a_meter_records_them():
    meter = DemandMeter()
    for m, keep in (("default", None), ("zero", 0), ("never", -1)):
        meter.begin(m, now=NOW)
        meter.end(m, now=NOW + 5, tokens=10, keep_alive=keep)
    models = [model(m, 0.5) for m in ("default", "zero", "never")]
    peers = [peer("p", 8)]

    def at(t: float) -> Assignment:
        return run(models, peers, meter.demand(now=t), now=t)

    soon = at(NOW + 5)
    assert soon.get("default") and soon.get("never") and soon.get("zero") is None
    assert "keep_alive 0" in soon.reason("zero")
    later = at(NOW + 5 + 301)
    assert later.get("default") is None and later.get("never") is not None
    assert "idle since 5m01s ago (keep_alive 5m00s)" in later.reason("default")
    assert at(NOW + 5 + 86400).get("never") is not None


def test_a_request_in_flight_keeps_its_model_placed_past_keep_alive():
    meter = DemandMeter()
    meter.begin("m", now=NOW)
    meter.end("m", now=NOW + 1, tokens=10, keep_alive=0)
    meter.begin("m", now=NOW + 2)  # a long one
    a = run([model("m", 1)], [peer("p", 4)], meter.demand(now=NOW + 900), now=NOW + 900)
    assert a.get("m") is not None


def test_a_model_too_big_for_the_mesh_says_what_it_needs():
    a = run([model("huge", 50)], [peer("p", 10), peer("q", 10)], {"huge": steady(5)})
    assert a.get("huge") is None
    assert "needs" in a.reason("huge") and "GB across the mesh" in a.reason("huge")


def test_a_model_that_fits_one_peer_is_not_split_when_others_hold_that_peer():
    # "big" fits p alone, but the pinned "held" is on p; q and r together could hold it
    # split. A model that fits one peer is served whole or not at all.
    models = [model("held", 1.5), model("big", 2)]
    peers = [peer("p", 3.5), peer("q", 1.5), peer("r", 1.5)]
    a = run(
        models,
        peers,
        {"big": steady(1), "held": steady(50)},
        pins=frozenset({"held"}),
        current={"held": Plan("held", CTX, replicas=("p",))},
    )
    assert peers_of(a, "held") == ("p",)
    assert a.get("big") is None
    reason = a.reason("big")
    assert reason.startswith("no memory anywhere: needs 2.00 GB on one peer, the largest free ")
    assert "pinned" in reason


def test_a_model_too_big_for_any_peer_is_split_over_shares_that_fit():
    models = [model("big", 3.0, layers=30), model("small", 0.5)]
    peers = [peer("p", 1.5), peer("q", 1.5), peer("r", 1.5), peer("s", 0.4)]
    a = run(models, peers, {"big": steady(1), "small": steady(1)})
    big = a.get("big")
    assert big is not None and big.plan.split
    assert len(big.plan.stages) >= 2
    check_shares_fit(a, peers)
    # The planner finds a plan on exactly those shares.
    assert plan(models[0], list(big.peers), context_tokens=CTX).split


def test_the_least_recently_used_model_gives_way_to_one_a_request_waits_for():
    models = [model("a", 2), model("b", 2), model("c", 2)]
    peers = [peer("p", 2.5), peer("q", 2.5)]
    current = {"a": Plan("a", CTX, replicas=("p",)), "b": Plan("b", CTX, replicas=("q",))}
    demand = {
        "a": steady(2, last_used=NOW - 100),
        "b": steady(3, last_used=NOW - 10),
        "c": replace(steady(8), in_flight=1),
    }
    a = run(models, peers, demand, current=current)
    assert peers_of(a, "c") == ("p",)
    assert peers_of(a, "b") == ("q",)
    assert a.reason("a").startswith("evicted for c, which a request waits for")
    # Pinned, "a" stays: the next least recently used goes.
    pinned = run(models, peers, demand, current=current, pins=frozenset({"a"}))
    assert peers_of(pinned, "a") == ("p",) and peers_of(pinned, "c") == ("q",)
    assert pinned.get("b") is None
    # Only kept alive (no request waits for it), "c" moves nothing aside: it waits for free
    # memory, and says why.
    kept = run(models, peers, {**demand, "c": steady(8)}, current=current)
    assert kept.get("c") is None and "no memory anywhere" in kept.reason("c")
    assert peers_of(kept, "a") == ("p",) and peers_of(kept, "b") == ("q",)
    # With requests in flight for all three, the one in least demand waits, crowded.
    busy = {m: replace(d, in_flight=1) for m, d in {**demand, "c": steady(1)}.items()}
    quiet = run(models, peers, busy, current=current)
    assert quiet.get("c") is None and quiet.crowded == ("c",)
    assert peers_of(quiet, "a") == ("p",) and peers_of(quiet, "b") == ("q",)


def test_a_model_only_kept_alive_gives_way_to_one_a_request_waits_for():
    # "a" served a lot and is kept alive, idle; "b" was asked for little, but a request for
    # it is in flight now: "a" goes, as ollama unloads an idle model for a request.
    models = [model("a", 2), model("b", 2)]
    peers = [peer("p", 2.5)]
    current = {"a": Plan("a", CTX, replicas=("p",))}
    demand = {"a": steady(8, last_used=NOW - 30), "b": replace(steady(1), in_flight=1)}
    a = run(models, peers, demand, current=current)
    assert peers_of(a, "b") == ("p",) and a.get("a") is None
    assert a.reason("a").startswith("evicted for b, which a request waits for")
    assert a.crowded == ()


def test_a_model_whose_memory_models_in_use_hold_is_crowded_and_waits():
    # Both asked for now: "a", placed and busy, keeps its peer; "b" is crowded (it would fit
    # alone), so its requests wait for "a" to go idle instead of failing.
    models = [model("a", 2), model("b", 2), model("huge", 50)]
    peers = [peer("p", 2.5)]
    current = {"a": Plan("a", CTX, replicas=("p",))}
    busy = {
        "a": replace(steady(8), in_flight=1),
        "b": replace(steady(1), in_flight=1),
        "huge": replace(steady(1), in_flight=1),
    }
    a = run(models, peers, busy, current=current)
    assert peers_of(a, "a") == ("p",) and a.get("b") is None
    assert a.crowded == ("b",)  # not "huge": it fits nowhere, whatever goes idle
    assert "no memory anywhere" in a.reason("b")
    idle = run(models, peers, {**busy, "a": steady(8)}, current=current)
    assert peers_of(idle, "b") == ("p",) and idle.crowded == ()


def test_a_placed_model_stays_where_it_is_when_a_faster_peer_is_free():
    models = [model("m", 1)]
    peers = [peer("slow", 2, speed=50), peer("fast", 2, speed=500)]
    fresh = run(models, peers, {"m": steady(1)})
    assert peers_of(fresh, "m") == ("fast",)
    kept = run(models, peers, {"m": steady(1)}, current={"m": Plan("m", CTX, replicas=("slow",))})
    assert peers_of(kept, "m") == ("slow",)


def test_replicas_grow_with_demand_in_one_go_and_never_onto_a_peer_that_adds_little():
    models = [model("m", 1)]
    peers = [peer(f"p{i}", 2) for i in range(6)] + [peer("crawl", 2, speed=5)]
    current = {"m": Plan("m", CTX, replicas=("p0",))}
    low = run(models, peers, {"m": steady(8)}, current=current)
    assert peers_of(low, "m") == ("p0",), "under what one replica serves: no growth"
    high = run(models, peers, {"m": steady(24)}, current=current)
    assert len(peers_of(high, "m")) == 5  # 24 tokens/s: under half of what 5 x 10 serve
    most = run(models, peers, {"m": steady(60)}, current=current)
    assert len(peers_of(most, "m")) == 6  # all the fast ones; the crawling one adds too little
    assert "crawl" not in peers_of(most, "m")


def demand_at(meter: DemandMeter, t: float) -> dict[str, Demand]:
    return meter.demand(now=t)


def follow(models, peers, rate_at, minutes: float, pins=frozenset()) -> list[tuple[str, ...]]:
    """The peers of model "m" at each 10 s step, its demand `rate_at(t)` tokens/s."""
    meter = DemandMeter()
    current: dict[str, Plan] = {}
    out = []
    t = NOW
    for _ in range(int(minutes * 6)):
        tokens = round(rate_at(t - NOW) * 10)
        if tokens:
            meter.begin("m", now=t - 5)
            meter.end("m", now=t, tokens=tokens)
        a = run(models, peers, meter.demand(now=t), now=t, current=current, pins=pins)
        current = a.plans()
        out.append(a.get("m").plan.peers if a.get("m") else ())
        t += 10
    return out


def test_no_flapping_on_a_demand_that_wobbles():
    models = [model("m", 1)]
    peers = [peer(f"p{i}", 2) for i in range(6)]

    def wobble(t: float) -> float:
        return 25.0 * (1.3 if int(t // 60) % 2 else 0.7)  # +-30% minute by minute

    steps = follow(models, peers, wobble, 40)
    changes = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1]]
    assert all(i < 6 * 5 for i in changes), f"changes after the first 5 minutes: {changes}"
    assert len(changes) <= 2


def test_replicas_shrink_only_after_demand_has_settled_low():
    models = [model("m", 1)]
    peers = [peer(f"p{i}", 2) for i in range(6)]
    steps = follow(models, peers, lambda t: 40.0 if t < 15 * 60 else 2.0, 40)
    busy = steps[15 * 6 - 1]
    assert len(busy) >= 4
    assert steps[18 * 6] == busy, "3 minutes after the drop, nothing has moved"
    assert len(steps[-1]) == 1
    drops = [i for i in range(1, len(steps)) if len(steps[i]) < len(steps[i - 1])]
    assert len(drops) == 1, "down in one go"


def test_a_spare_replica_makes_way_for_a_model_on_a_much_faster_peer():
    models = [model("x", 2), model("y", 2)]
    peers = [peer("gpu", 2.5, speed=1000), peer("cpu-a", 2.5), peer("cpu-b", 2.5)]
    current = {"x": Plan("x", CTX, replicas=("cpu-a", "gpu"))}
    # x asks 3 tokens/s of late (not settled, so it does not shrink of itself): its cpu-a
    # replica serves that under half of what it can. y, new, would crawl on cpu-b.
    b = bucket_of(NOW)
    rising = Demand(
        tuple(Bucket(i, 1, 180 if i >= b - 2 else 30) for i in range(b - 10, b)),
        NOW,
        NOW + 300,
    )
    assert rising.tokens_per_s(NOW, 120) == 3.0
    a = run(models, peers, {"x": rising, "y": steady(5)}, current=current)
    assert peers_of(a, "y") == ("gpu",)
    assert peers_of(a, "x") == ("cpu-a",)


def test_models_go_where_the_compute_is_free():
    models = [model("a", 1), model("b", 1)]
    peers = [peer("fast", 4, speed=200), peer("other", 4, speed=150)]
    current = {"a": Plan("a", CTX, replicas=("fast",))}
    # a keeps "fast" busy: b is served faster on "other".
    a = run(models, peers, {"a": steady(19), "b": steady(5)}, current=current)
    assert peers_of(a, "b") == ("other",)


def test_a_model_goes_where_its_entrys_draft_model_costs_it_least():
    # One GFLOP a layer: speeds are GFLOP/s and layers per second alike. "drafter" is 5%
    # faster, but its draft model (2 GFLOP a token, a fifth of the model's 10) makes a token
    # take 114 ms there against 100 ms on "plain".
    m = replace(model("m", 1), flops_per_layer=1e9)
    drafter = peer("drafter", 4, speed=105, draft_gflops=2.0)
    plain = peer("plain", 4, speed=100)
    for peers in ([drafter, plain], [plain, drafter]):
        a = run([m], peers, {"m": steady(1)})
        assert peers_of(a, "m") == ("plain",)
    a = run([m], [replace(drafter, draft_gflops=0.0), plain], {"m": steady(1)})
    assert peers_of(a, "m") == ("drafter",)


def test_restrict_cuts_the_services_capacities_to_the_shares():
    models = [model("a", 1), model("b", 1)]
    peers = [peer("p", 4, vram_bytes=2 * GB, vram_speed=900.0, spare_bytes=GB)]
    a = run(models, peers, {"a": steady(5), "b": steady(1)})
    placed = a.get("a")
    assert placed is not None
    service_caps = [replace(peers[0], speed=7.0), peer("elsewhere", 9)]
    cut = restrict(placed, service_caps)
    assert [c.peer_id for c in cut] == ["p"]
    share = placed.share("p")
    assert cut[0].speed == 7.0
    assert (cut[0].memory_bytes, cut[0].vram_bytes, cut[0].spare_bytes) == (
        share.memory_bytes,
        share.vram_bytes,
        share.spare_bytes,
    )
    assert share.vram_bytes > 0, "the most demanded model gets the device memory"


def test_replica_share_takes_vram_first_and_refuses_what_does_not_fit():
    m = model("m", 1)
    gpu = peer("g", 0.2, vram_bytes=2 * GB, vram_speed=900.0)
    cut = replica_share(m, gpu, context_tokens=CTX)
    assert cut is not None and cut.memory_bytes == 0 and cut.vram_bytes >= GB
    assert replica_share(m, peer("tiny", 0.5), context_tokens=CTX) is None


# Determinism: random tables, shuffled.

tables = st.fixed_dictionaries(
    {
        "peers": st.lists(
            st.tuples(st.floats(0.5, 12), st.floats(10, 500), st.floats(0, 8)),
            min_size=1,
            max_size=7,
        ),
        "models": st.lists(st.tuples(st.floats(0.2, 10), st.floats(0, 60)), min_size=1, max_size=5),
        "current": st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=6),
        "seed": st.integers(0, 1000),
    }
)


@settings(max_examples=60, deadline=None)
@given(tables)
def test_every_order_gives_the_same_assignment_and_shares_fit(t):
    peers = [
        peer(f"p{i}", gb, speed, vram_bytes=int(v * GB), vram_speed=speed * 8 if v else 0.0)
        for i, (gb, speed, v) in enumerate(t["peers"])
    ]
    models = [model(f"m{i}", gb) for i, (gb, _) in enumerate(t["models"])]
    demand = {f"m{i}": steady(rate) for i, (_, rate) in enumerate(t["models"]) if rate > 0}
    current: dict[str, Plan] = {}
    for mi, pi in t["current"]:
        if mi < len(models) and pi < len(peers):
            m = f"m{mi}"
            old = current.get(m)
            replicas = tuple(sorted({*(old.replicas if old else ()), f"p{pi}"}))
            current[m] = Plan(m, CTX, replicas=replicas)
    first = run(models, peers, demand, current=current, pins=frozenset({"m0"}))
    check_shares_fit(first, peers)
    rng = random.Random(t["seed"])
    for _ in range(3):
        ps, ms, ds = peers[:], models[:], list(demand.items())
        rng.shuffle(ps)
        rng.shuffle(ms)
        rng.shuffle(ds)
        again = run(ms, ps, dict(ds), current=dict(current), pins=frozenset({"m0"}))
        assert again == first
    placed = {p.model_id for p in first.placed}
    assert placed | {m for m, _ in first.not_placed} == {m.model_id for m in models}
    assert not placed & {m for m, _ in first.not_placed}


def test_only_peers_that_take_part_in_a_model_are_given_it():
    models = [model("m", 1), model("n", 1)]
    peers = [peer("fast", 4, speed=500), peer("slow", 4)]
    demand = {"m": steady(100), "n": steady(1)}
    a = run(models, peers, demand, eligible={"m": frozenset({"slow"})})
    assert peers_of(a, "m") == ("slow",), "fast is faster, and does not take part in m"
    assert a.get("n") is None
    assert a.reason("n") == "no peer takes part in n (none has its file or can fetch it)"
    kept = run(
        models,
        peers,
        demand,
        eligible={"m": frozenset({"slow"}), "n": frozenset({"fast", "slow"})},
        current={"m": Plan("m", CTX, replicas=("fast", "slow"))},
    )
    assert peers_of(kept, "m") == ("slow",), "a current replica on a peer that left it goes"


def test_a_peer_holding_the_file_goes_first_among_about_as_fast():
    models = [model("m", 1)]
    peers = [peer("a", 4, speed=100), peer("b", 4, speed=95)]
    a = run(models, peers, {"m": steady(1)}, holders={"m": frozenset({"b"})})
    assert peers_of(a, "m") == ("b",)
    far = run(models, [peer("a", 4, speed=200), peer("b", 4, speed=95)], {"m": steady(1)},
              holders={"m": frozenset({"b"})})  # fmt: skip
    assert peers_of(far, "m") == ("a",), "twice as fast: worth the download"


def test_a_pinned_model_fills_the_peers_that_hold_it_and_those_replicas_give_way_first():
    pinned, big = model("pinned", 1.0), model("big", 3.3)
    peers = [peer(p, 4.0) for p in "abc"]
    a = run([pinned, big], peers, {}, pins=frozenset({"pinned"}))
    assert sorted(peers_of(a, "pinned")) == ["a", "b", "c"]  # free memory: kept loaded on all
    assert a.get("big") is None
    # `big` is asked for: one of the pinned model's replicas gives way to it, the rest stay.
    b = run(
        [pinned, big], peers, {"big": steady(5.0)}, pins=frozenset({"pinned"}), current=a.plans()
    )
    [host] = peers_of(b, "big")
    assert sorted(peers_of(b, "pinned")) == sorted({"a", "b", "c"} - {host})
    check_shares_fit(b, peers)
