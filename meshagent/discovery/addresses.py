"""Which overlay addresses to tell others about, from the addresses we listen on."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import ifaddr

from meshagent.net.address import Address

_WILDCARDS = ("0.0.0.0", "::", "")


def interface_ipv4s(*, include_loopback: bool = False) -> list[str]:
    """This host's IPv4 addresses (in the current network namespace), loopback last."""
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.ip not in found:
                found.append(ip.ip)
    routable = [a for a in found if not ipaddress.ip_address(a).is_loopback]
    loopback = [a for a in found if ipaddress.ip_address(a).is_loopback]
    return routable + (loopback if include_loopback else [])


def is_loopback_only(listen: list[Address]) -> bool:
    """Whether every listen address is a loopback one (nothing off this host can dial us)."""
    return bool(listen) and all(
        a.host not in _WILDCARDS and ipaddress.ip_address(a.host).is_loopback
        for a in listen
        if _is_ip(a.host)
    )


def advertised(listen: list[Address], extra: Sequence[str] = ()) -> list[str]:
    """host:port addresses peers can dial: `extra` first (given by the user: `--address`),
    then the listen addresses, a wildcard as every routable interface address (or loopback if
    there is none), a specific address as it is."""
    out: list[str] = [str(Address.parse(a)) for a in extra]
    for a in listen:
        if a.host in _WILDCARDS:
            hosts = interface_ipv4s() or ["127.0.0.1"]
            out += [str(Address(h, a.port)) for h in hosts]
        else:
            out.append(str(a))
    return list(dict.fromkeys(out))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
