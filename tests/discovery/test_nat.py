"""What the relays' observations say of this agent's NAT (`discovery/nat.py`)."""

from __future__ import annotations

from meshagent.discovery import nat
from meshagent.discovery.nat import Observation, Observations
from meshagent.net.address import Address

RELAY = Address("10.240.1.1", 9339)
OBSERVE = Address("10.240.1.1", 9340)
LOCAL = Address("192.168.1.2", 9338)


def _obs(own=("192.168.1.2", "127.0.0.1")) -> Observations:
    return Observations(own_hosts=lambda: own)


def test_nothing_observed_is_unknown():
    assert _obs().reachability(9338) == nat.Reachability(nat.UNKNOWN, ())


def test_seen_at_an_own_address_is_no_nat():
    o = _obs(own=("10.240.1.2",))
    o.add(Observation(RELAY, Address("10.240.1.2", 9338), Address("10.240.1.2", 9338)))
    assert o.reachability(9338).nat == nat.NONE
    assert o.reachability(9338).public == ()


def test_one_public_address_from_two_ports_is_a_cone():
    o = _obs()
    assert o.add(Observation(RELAY, LOCAL, Address("203.0.113.5", 9338)))
    one = o.reachability(9338)
    assert (one.nat, one.public) == (nat.UNKNOWN, ("203.0.113.5:9338",))  # one observer
    assert not o.add(Observation(RELAY, LOCAL, Address("203.0.113.5", 9338)))  # no news
    o.add(Observation(OBSERVE, LOCAL, Address("203.0.113.5", 9338)))
    two = o.reachability(9338)
    assert (two.nat, two.public, two.public_hosts) == (
        nat.INDEPENDENT,
        ("203.0.113.5:9338",),
        ("203.0.113.5",),
    )


def test_a_new_public_port_per_destination_is_symmetric():
    o = _obs()
    o.add(Observation(RELAY, LOCAL, Address("203.0.113.5", 40001)))
    o.add(Observation(OBSERVE, LOCAL, Address("203.0.113.5", 51234)))
    r = o.reachability(9338)
    assert (r.nat, r.public, r.public_hosts) == (nat.DEPENDENT, (), ("203.0.113.5",))
    assert r.to_dict()["said"].endswith("(symmetric)")


def test_observations_from_another_port_do_not_count():
    o = _obs()
    o.add(Observation(RELAY, Address("192.168.1.2", 51000), Address("203.0.113.5", 51000)))
    assert o.reachability(9338).nat == nat.UNKNOWN
