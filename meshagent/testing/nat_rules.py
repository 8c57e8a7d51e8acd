"""Emulated NATs: the nftables ruleset of a router namespace that hides one host behind its
outside address, for each kind of NAT the hole-punching tests and net-sim run against.

| kind | mapping (outside port of a connection) | filtering (what may come in) |
|---|---|---|
| `none` | - (the host has a public address, no router) | everything |
| `full-cone` | the inside port, for every destination | anyone, to a mapped port |
| `address-restricted` | the inside port, for every destination | hosts the inside has sent to |
| `port-restricted` | the inside port, for every destination | only the exact host:port sent to |
| `symmetric` | a random port per connection (`fully-random`) | only the exact host:port sent to |

Linux's masquerade keeps the inside port where it is free, so the cone kinds map
independently of the destination; `fully-random` gives the symmetric one. Filtering follows
from conntrack (what answers a connection the inside opened, a simultaneous open included),
widened by a DNAT of new connections for the two laxer kinds. Unsolicited packets are dropped
silently, as home routers do (no RST, no ICMP).
"""

from __future__ import annotations

KINDS = ("none", "full-cone", "address-restricted", "port-restricted", "symmetric")


def ruleset(kind: str, *, outside: str, inside: str, host: str) -> str:
    """nftables rules for a router whose interface `outside` faces the internet and `inside`
    the host at address `host`."""
    if kind not in KINDS or kind == "none":
        raise ValueError(f"no NAT rules for kind {kind!r}; the kinds are {', '.join(KINDS[1:])}")
    random = " fully-random" if kind == "symmetric" else ""
    if kind == "full-cone":
        dnat = f'iifname "{outside}" meta l4proto tcp dnat to {host}'
        let_in = f'iifname "{outside}" ct status dnat accept'
    elif kind == "address-restricted":
        dnat = f'iifname "{outside}" meta l4proto tcp ip saddr @contacted dnat to {host}'
        let_in = f'iifname "{outside}" ip saddr @contacted ct status dnat accept'
    else:
        dnat = let_in = ""
    return f"""
table ip meshnat {{
    set contacted {{ type ipv4_addr; flags dynamic, timeout; timeout 10m; }}
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        {dnat}
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{outside}" masquerade{random}
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{inside}" update @contacted {{ ip daddr }} accept
        {let_in}
    }}
    chain input {{
        type filter hook input priority filter; policy drop;
        iifname "lo" accept
        iifname "{inside}" accept
        ct state established,related accept
    }}
}}
"""
