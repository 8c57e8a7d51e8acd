import pytest
from netsim.regimes import LAN, LONGHAUL, RELAY, WAN, Topology, topology


def test_regime_figures():
    assert (LAN.delay_s, LAN.jitter_s, LAN.loss, LAN.rate_bps) == (0.0005, 0.0, 0.0, 1e9)
    assert (WAN.delay_s, WAN.loss, WAN.rate_bps) == (0.015, 0.001, 100e6)
    assert WAN.jitter_s == pytest.approx(0.0003)
    assert (LONGHAUL.delay_s, LONGHAUL.loss, LONGHAUL.rate_bps) == (0.075, 0.005, 50e6)
    assert LONGHAUL.jitter_s == pytest.approx(0.00075)


def test_lan_is_one_segment_fully_linked():
    t = topology("lan", 3)
    assert t.hosts == ("h0", "h1", "h2")
    assert all(t.same_segment(a, b) for a in t.hosts for b in t.hosts)
    assert t.link("h0", "h2") == LAN and t.link("h2", "h0") == LAN


@pytest.mark.parametrize(("name", "spec"), [("wan", WAN), ("longhaul", LONGHAUL)])
def test_wide_regimes_link_every_host_but_share_no_segment(name, spec):
    t = topology(name, 3)
    assert not t.same_segment("h0", "h1")
    assert t.link("h1", "h2") == spec


def test_mixed_is_a_lan_pair_and_a_far_host():
    t = topology("mixed", 3)
    assert t.same_segment("h0", "h1") and not t.same_segment("h0", "h2")
    assert t.link("h0", "h1") == LAN
    assert t.link("h0", "h2") == WAN and t.link("h2", "h1") == WAN
    with pytest.raises(ValueError, match="at least 3"):
        topology("mixed", 2)


def test_isolated_hosts_meet_only_at_the_relay():
    t = topology("wan", 2, relay=True, isolated=True)
    assert t.hosts == ("h0", "h1", RELAY)
    assert t.link("h0", "h1") is None
    assert t.link("h0", RELAY) == WAN and t.link(RELAY, "h1") == WAN
    assert not t.same_segment("h0", "h1")


def test_with_link_and_round_trip():
    t = topology("lan", 2).with_link("h0", "h1", None, both=False)
    assert t.link("h0", "h1") is None and t.link("h1", "h0") == LAN
    assert Topology.from_dict(t.to_dict()) == t


def test_rejects_unknown_regime_and_bad_links():
    with pytest.raises(ValueError, match="unknown regime"):
        topology("satellite", 2)
    with pytest.raises(ValueError, match="does not join"):
        Topology(("a",), {"a": None}, {("a", "b"): LAN})
