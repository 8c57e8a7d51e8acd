"""Advertised addresses and the loopback-only rule that keeps mDNS off the host network."""

from __future__ import annotations

from meshagent.discovery import addresses
from meshagent.net.address import Address


def test_specific_addresses_are_advertised_as_they_are():
    assert addresses.advertised([Address("10.1.2.3", 9338)]) == ["10.1.2.3:9338"]


def test_wildcard_becomes_interface_addresses(monkeypatch):
    monkeypatch.setattr(addresses, "interface_ipv4s", lambda: ["10.0.0.5", "192.168.1.9"])
    assert addresses.advertised([Address("0.0.0.0", 7)]) == ["10.0.0.5:7", "192.168.1.9:7"]
    monkeypatch.setattr(addresses, "interface_ipv4s", lambda: [])
    assert addresses.advertised([Address("0.0.0.0", 7)]) == ["127.0.0.1:7"]


def test_loopback_only():
    assert addresses.is_loopback_only([Address("127.0.0.1", 1)])
    assert not addresses.is_loopback_only([Address("0.0.0.0", 1)])
    assert not addresses.is_loopback_only([Address("127.0.0.1", 1), Address("10.0.0.1", 2)])


def test_interface_addresses_put_loopback_last():
    found = addresses.interface_ipv4s(include_loopback=True)
    assert "127.0.0.1" in found
    assert found[-1].startswith("127.")
