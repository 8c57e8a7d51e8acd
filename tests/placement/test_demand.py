"""Demand per model: the meter's buckets and rates, keep_alive as ollama has it, the sum of
what peers gossip."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from meshagent.gossip.failure import PeerState
from meshagent.placement.demand import (
    BUCKET_S,
    DEFAULT_KEEP_ALIVE_S,
    EXTRAS_KEY,
    MAX_MODELS,
    NEVER,
    WINDOW_S,
    Bucket,
    Demand,
    DemandError,
    DemandMeter,
    from_cbor,
    gossiped,
    keep_alive_seconds,
    merge,
    to_cbor,
)

T0 = 1_800_000_000.0  # a wall-clock time, on a bucket's edge


def one(meter: DemandMeter, model: str, now: float, tokens: int, keep_alive=None) -> None:
    meter.begin(model, now=now)
    meter.end(model, now=now, tokens=tokens, keep_alive=keep_alive)


def test_requests_and_tokens_land_in_the_bucket_of_their_time():
    meter = DemandMeter()
    one(meter, "m", T0 + 1, 100)
    one(meter, "m", T0 + 59, 50)
    one(meter, "m", T0 + 61, 30)
    d = meter.demand(now=T0 + 61)["m"]
    first = int(T0 // BUCKET_S)
    assert d.buckets == (Bucket(first, 2, 150), Bucket(first + 1, 1, 30))
    assert d.in_flight == 0
    assert d.last_used == T0 + 61


def test_rates_count_the_window_and_part_of_the_bucket_it_began_in():
    meter = DemandMeter()
    for minute in range(10):
        one(meter, "m", T0 + minute * BUCKET_S + 1, 600)  # 600 tokens a minute
    now = T0 + 10 * BUCKET_S - 1
    d = meter.demand(now=now)["m"]
    assert d.tokens_per_s(now) == pytest.approx(10.0, rel=0.01)
    assert d.tokens_per_s(now, 2 * BUCKET_S) == pytest.approx(10.0, rel=0.01)
    assert d.requests_per_s(now) == pytest.approx(1 / 60, rel=0.01)
    assert d.peak_per_s(now) == pytest.approx(10.0)
    # Nothing more for a while: the rate falls as buckets leave the window.
    later = now + WINDOW_S / 2
    assert meter.demand(now=later)["m"].tokens_per_s(later) == pytest.approx(5.0, rel=0.05)


def test_buckets_older_than_the_window_are_dropped_and_so_is_an_idle_model():
    meter = DemandMeter()
    one(meter, "m", T0, 100)
    assert meter.demand(now=T0 + WINDOW_S - 1)["m"].buckets
    assert "m" not in meter.demand(now=T0 + WINDOW_S + BUCKET_S)


def test_keep_alive_default_is_five_minutes_after_the_request_ends():
    meter = DemandMeter()
    meter.begin("m", now=T0)
    d = meter.demand(now=T0 + 3600)["m"]
    assert d.wanted(T0 + 3600), "a request in flight keeps its model wanted"
    meter.end("m", now=T0 + 10, tokens=5)
    d = meter.demand(now=T0 + 10)["m"]
    assert d.expires_at == T0 + 10 + DEFAULT_KEEP_ALIVE_S
    assert d.wanted(T0 + 10 + DEFAULT_KEEP_ALIVE_S - 1)
    assert not d.wanted(T0 + 10 + DEFAULT_KEEP_ALIVE_S)


def test_keep_alive_zero_expires_at_the_end_and_negative_never():
    meter = DemandMeter()
    one(meter, "zero", T0, 5, keep_alive=0)
    one(meter, "never", T0, 5, keep_alive=-1)
    d = meter.demand(now=T0)
    assert not d["zero"].wanted(T0)
    assert d["never"].expires_at == NEVER
    assert d["never"].wanted(T0 + 10 * 86400)


def test_the_last_request_to_end_sets_the_expiry():
    meter = DemandMeter()
    one(meter, "m", T0, 5, keep_alive=-1)
    one(meter, "m", T0 + 5, 5, keep_alive=60)
    assert meter.demand(now=T0 + 5)["m"].expires_at == T0 + 65


def test_a_meter_keeps_at_most_the_most_recently_used_models():
    meter = DemandMeter()
    for i in range(MAX_MODELS + 8):
        one(meter, f"m{i:02d}", T0 + i, 1)
    d = meter.demand(now=T0 + 100)
    assert len(d) == MAX_MODELS
    assert "m00" not in d and f"m{MAX_MODELS + 7:02d}" in d


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(None, None), (0, 0.0), (-1, -1.0), ("-1", -1.0), ("5m", 300.0), ("1h30m", 5400.0),
     ("90s", 90.0), ("500ms", 0.5), (12.5, 12.5), ("0", 0.0)],
)  # fmt: skip
def test_keep_alive_reads_as_ollama_takes_it(given, seconds):
    assert keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("bad", ["", "-", "soon", "5 minutes", True, math.nan, math.inf, [5]])
def test_keep_alive_that_is_no_duration_is_refused(bad):
    with pytest.raises(DemandError, match="keep_alive"):
        keep_alive_seconds(bad)


def test_the_gossiped_form_round_trips():
    meter = DemandMeter()
    one(meter, "a", T0, 10, keep_alive=-1)
    one(meter, "b", T0 + 70, 20)
    meter.begin("b", now=T0 + 75)
    d = meter.demand(now=T0 + 80)
    assert from_cbor(to_cbor(d)) == d


def test_merge_adds_buckets_by_number_and_takes_the_latest_times():
    a = {"m": Demand((Bucket(10, 1, 100), Bucket(11, 2, 50)), 700.0, 900.0, 1)}
    b = {"m": Demand((Bucket(11, 1, 5), Bucket(12, 4, 40)), 720.0, 800.0, 2), "n": Demand()}
    c = {"m": Demand((), 0.0, NEVER, 0)}
    merged = merge([a, b, c])
    assert merged["m"] == Demand(
        (Bucket(10, 1, 100), Bucket(11, 3, 55), Bucket(12, 4, 40)), 720.0, NEVER, 3
    )
    assert merged["n"] == Demand()
    for seed in range(5):
        parts = [a, b, c]
        random.Random(seed).shuffle(parts)
        assert merge(parts) == merged


def view(extras, state=PeerState.ALIVE) -> SimpleNamespace:
    return SimpleNamespace(state=state, record=SimpleNamespace(extras=extras))


def test_gossiped_demand_sums_alive_peers_and_skips_a_bad_form():
    meter = DemandMeter()
    one(meter, "m", T0, 100)
    good = to_cbor(meter.demand(now=T0))
    views = {
        "a": view({EXTRAS_KEY: good}),
        "b": view({EXTRAS_KEY: good}),
        "dead": view({EXTRAS_KEY: good}, PeerState.DEAD),
        "bad": view({EXTRAS_KEY: {0: 1, 1: {"m": [0, -5.0, None, []]}}}),
        "none": view({}),
    }
    d = gossiped(views)
    assert d["m"].buckets == (Bucket(int(T0 // BUCKET_S), 2, 200),)
