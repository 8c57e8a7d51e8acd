import itertools
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from netsim.linkmodel import MIN_QUEUE_BYTES, Drop, Link, LinkSpec


def test_delay_is_added():
    link = Link(LinkSpec(delay_s=0.015), 1)
    assert link.send(10.0, 100) == pytest.approx(10.015)
    assert link.send(11.0, 1500) == pytest.approx(11.015)


def test_jitter_stays_within_bounds_and_never_reorders():
    spec = LinkSpec.with_jitter_fraction(0.075, 0.01)
    assert spec.jitter_s == pytest.approx(0.00075)
    link = Link(spec, 7)
    rng = random.Random(3)
    now, last, spread = 0.0, 0.0, []
    for _ in range(5000):
        now += rng.expovariate(2000)  # packets often closer together than the jitter
        t = link.send(now, 200)
        assert isinstance(t, float)
        assert t >= last
        assert now + spec.delay_s - spec.jitter_s <= t
        last = t
        spread.append(t - now - spec.delay_s)
    # Alone (not held behind the previous packet) a packet arrives within the jitter bound.
    sparse = Link(spec, 8)
    lone = [sparse.send(i * 1.0, 200) - i * 1.0 for i in range(2000)]
    assert min(lone) >= spec.delay_s - spec.jitter_s
    assert max(lone) <= spec.delay_s + spec.jitter_s
    assert max(lone) - min(lone) > spec.jitter_s  # the jitter is really there
    assert statistics.mean(lone) == pytest.approx(spec.delay_s, abs=spec.jitter_s / 10)


def test_loss_rate_close_to_configured():
    link = Link(LinkSpec(delay_s=0.001, loss=0.02), 42)
    verdicts = [link.send(i * 0.001, 100) for i in range(50_000)]
    lost = sum(v is Drop.LOSS for v in verdicts)
    assert lost / len(verdicts) == pytest.approx(0.02, rel=0.1)


def test_same_seed_same_decisions():
    spec = LinkSpec(delay_s=0.01, jitter_s=0.002, loss=0.1)
    a, b = Link(spec, 5), Link(spec, 5)
    assert [a.send(i * 0.003, 100) for i in range(500)] == [
        b.send(i * 0.003, 100) for i in range(500)
    ]


def test_rate_paces_to_configured_throughput():
    rate = 100e6
    link = Link(LinkSpec(delay_s=0.015, rate_bps=rate), 0)
    # Offer 1500-byte packets at twice the rate, within the queue: departures are paced.
    departures = []
    now = 0.0
    for _ in range(200):
        t = link.send(now, 1500)
        assert isinstance(t, float)
        departures.append(t)
        now += 1500 * 8 / (2 * rate)
    gaps = [b - a for a, b in itertools.pairwise(departures)]
    assert all(g == pytest.approx(1500 * 8 / rate) for g in gaps)
    assert departures[0] == pytest.approx(1500 * 8 / rate + 0.015)


def test_sustained_overload_is_cut_to_rate_by_the_queue():
    rate = 10e6
    spec = LinkSpec(delay_s=0.01, rate_bps=rate)
    link = Link(spec, 0)
    delivered = dropped = 0
    for i in range(20_000):  # 1000-byte packets at 4x the rate, for 4 s
        v = link.send(i * 1000 * 8 / (4 * rate), 1000)
        if v is Drop.QUEUE:
            dropped += 1
        else:
            delivered += 1
            # never more than a queue's worth of waiting behind the wire
            assert v - i * 1000 * 8 / (4 * rate) <= spec.queue_cap * 8 / rate + 0.01 + 1e-9
    assert delivered * 1000 * 8 / 4.0 == pytest.approx(rate, rel=0.02)
    assert dropped > 0


def test_queue_cap_is_one_bandwidth_delay_product_with_a_floor():
    assert LinkSpec(delay_s=0.015, rate_bps=100e6).queue_cap == 375_000
    assert LinkSpec(delay_s=0.0, rate_bps=1e9).queue_cap == MIN_QUEUE_BYTES
    assert LinkSpec(delay_s=0.015, rate_bps=100e6, queue_bytes=3000).queue_cap == 3000


def test_an_empty_queue_takes_a_packet_bigger_than_its_cap():
    link = Link(LinkSpec(rate_bps=1e6, queue_bytes=100), 0)
    assert isinstance(link.send(0.0, 1500), float)
    assert link.send(0.0, 1500) is Drop.QUEUE


def test_partition_drops_everything_while_down_then_heals():
    spec = LinkSpec(delay_s=0.01)
    link = Link(spec, 0)
    before = link.send(0.0, 100)
    link.set_spec(spec.replace(up=False))
    assert all(link.send(0.1 + i * 0.001, 100) is Drop.PARTITION for i in range(1000))
    link.set_spec(spec)
    after = link.send(2.0, 100)
    assert before == pytest.approx(0.01)
    assert after == pytest.approx(2.01)


def test_a_faster_spec_does_not_overtake_packets_already_sent():
    link = Link(LinkSpec(delay_s=0.075), 0)
    first = link.send(0.0, 100)
    link.set_spec(LinkSpec(delay_s=0.001))
    assert link.send(0.001, 100) == pytest.approx(first)


def test_spec_round_trips_and_rejects_nonsense():
    spec = LinkSpec(delay_s=0.015, jitter_s=0.0003, loss=0.001, rate_bps=1e8, up=False)
    assert LinkSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown"):
        LinkSpec.from_dict({"delay": 1})
    with pytest.raises(ValueError):
        LinkSpec(loss=1.5)
    with pytest.raises(ValueError):
        LinkSpec(delay_s=-1)


@given(
    st.floats(0, 0.2),
    st.floats(0, 1),
    st.lists(st.tuples(st.floats(0, 0.01), st.integers(20, 9000)), max_size=200),
)
def test_departures_are_monotonic_and_never_early(delay, jitter_fraction, arrivals):
    spec = LinkSpec.with_jitter_fraction(delay, jitter_fraction, rate_bps=1e7, loss=0.1)
    link = Link(spec, 0)
    now = last = 0.0
    for gap, size in arrivals:
        now += gap
        v = link.send(now, size)
        if isinstance(v, Drop):
            continue
        assert v >= last
        assert v >= now + size * 8 / spec.rate_bps - 1e-12
        last = v
