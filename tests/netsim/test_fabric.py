import socket
import struct

import pytest
from netsim.fabric import NO_ROUTE, NOT_IPV4, Fabric
from netsim.linkmodel import LinkSpec
from netsim.regimes import Topology, topology


def ipv4(src: str, dst: str, payload: bytes = b"x" * 20) -> bytes:
    header = struct.pack(
        ">BBHHHBBH4s4s",
        0x45, 0, 20 + len(payload), 0, 0, 64, 17, 0,
        socket.inet_aton(src), socket.inet_aton(dst),
    )  # fmt: skip
    return header + payload


NET = "10.77.0.0/24"


def test_unicast_goes_to_the_addressed_host_after_the_link_delay():
    f = Fabric(topology("wan", 3), NET)
    assert f.address("h2") == "10.77.0.3"
    [(when, dst)] = f.route(1.0, 0, ipv4("10.77.0.1", "10.77.0.3"))
    assert dst == 2
    assert when == pytest.approx(1.015, abs=0.001)
    c = f.counters()["links"]["h0>h2"]
    assert c["packets"] == 1 and c["bytes"] == 40


def test_multicast_reaches_the_segment_only():
    f = Fabric(topology("mixed", 3), NET)
    mdns = ipv4("10.77.0.1", "224.0.0.251")
    assert [dst for _, dst in f.route(0.0, 0, mdns)] == [1]
    assert f.route(0.0, 2, ipv4("10.77.0.3", "224.0.0.251")) == []
    assert f.counters()["unrouted"]["h2"]["dropped"] == {NO_ROUTE: 1}
    assert [dst for _, dst in f.route(0.0, 0, ipv4("10.77.0.1", "10.77.0.255"))] == [1]


def test_isolated_hosts_and_unknown_addresses_are_dropped_and_counted():
    f = Fabric(topology("lan", 2, relay=True, isolated=True), NET)
    assert f.route(0.0, 0, ipv4("10.77.0.1", "10.77.0.2")) == []
    assert [dst for _, dst in f.route(0.0, 0, ipv4("10.77.0.1", "10.77.0.3"))] == [2]
    assert f.route(0.0, 0, ipv4("10.77.0.1", "8.8.8.8")) == []
    assert f.route(0.0, 0, b"\x60" + b"\0" * 39) == []
    c = f.counters()
    assert c["links"]["h0>h1"]["dropped"] == {NO_ROUTE: 1}
    assert c["unrouted"]["h0"]["dropped"] == {NO_ROUTE: 1, NOT_IPV4: 1}


def test_partition_and_heal_both_directions():
    f = Fabric(topology("lan", 2), NET)
    f.set_up("h0", "h1", up=False)
    assert f.route(0.0, 0, ipv4("10.77.0.1", "10.77.0.2")) == []
    assert f.route(0.0, 1, ipv4("10.77.0.2", "10.77.0.1")) == []
    f.set_up("h0", "h1", up=True)
    assert len(f.route(0.0, 1, ipv4("10.77.0.2", "10.77.0.1"))) == 1
    assert f.counters()["links"]["h0>h1"]["dropped"] == {"partition": 1}


def test_set_link_changes_one_direction():
    f = Fabric(topology("lan", 2), NET)
    f.set_link("h0", "h1", LinkSpec(delay_s=0.1))
    [(when, _)] = f.route(0.0, 0, ipv4("10.77.0.1", "10.77.0.2"))
    assert when == pytest.approx(0.1)
    assert f.spec("h1", "h0").delay_s == 0.0005
    with pytest.raises(ValueError, match="no link"):
        Fabric(Topology(("a", "b"), {"a": None, "b": None}), NET).set_link("a", "b", LinkSpec())
