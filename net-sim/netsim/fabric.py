"""Where a packet goes, and when: the emulator's forwarding decisions, without I/O.

`Fabric.route(now, src, packet)` looks at an IPv4 packet that host `src` sent, finds the
destination host by address (multicast and broadcast: every other host on `src`'s segment),
passes it through the `Link` of each (src, dst) direction and returns the deliveries with their
times. Everything it decides is counted per link and per reason, for reports of bytes on the wire.
"""

from __future__ import annotations

import ipaddress
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

from netsim.linkmodel import Drop, Link, LinkSpec
from netsim.regimes import Topology

# Why a packet was not forwarded, beyond the link's own reasons.
# No link between the two hosts (isolated), an unknown address, or multicast from a host
# with no other host on its segment.
NO_ROUTE = "no_route"
NOT_IPV4 = "not_ipv4"


@dataclass
class LinkCounters:
    """Packets and bytes (whole IP packets) that left a link, and those dropped, by reason."""

    packets: int = 0
    bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_bytes: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, length: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.dropped_bytes[reason] = self.dropped_bytes.get(reason, 0) + length

    def to_dict(self) -> dict[str, Any]:
        return {
            "packets": self.packets,
            "bytes": self.bytes,
            "dropped": dict(self.dropped),
            "dropped_bytes": dict(self.dropped_bytes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkCounters:
        return cls(d["packets"], d["bytes"], dict(d["dropped"]), dict(d["dropped_bytes"]))


def host_address(network: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Address:
    """The address of host number `index` (0-based) in the lab's network."""
    return network.network_address + index + 1


class Fabric:
    """The hosts of a topology, addressed `network.1`, `.2`, ... in host order."""

    def __init__(self, topology: Topology, network: str, *, seed: int = 0) -> None:
        self.topology = topology
        self.network = ipaddress.IPv4Network(network)
        if len(topology.hosts) + 2 > self.network.num_addresses:
            raise ValueError(f"{network} is too small for {len(topology.hosts)} hosts")
        self.hosts = topology.hosts
        self._index = {h: i for i, h in enumerate(self.hosts)}
        self._by_address = {host_address(self.network, i).packed: i for i in range(len(self.hosts))}
        self._broadcast = {self.network.broadcast_address.packed, b"\xff\xff\xff\xff"}
        n = len(self.hosts)
        self._links: list[list[Link | None]] = [[None] * n for _ in range(n)]
        self._counters = [[LinkCounters() for _ in range(n)] for _ in range(n)]
        self._unrouted = [LinkCounters() for _ in range(n)]  # per sender: no host to go to
        for (a, b), spec in topology.links.items():
            # One stream of randomness per direction, stable across runs and host counts.
            link_seed = zlib.crc32(f"{seed}:{a}>{b}".encode())
            self._links[self._index[a]][self._index[b]] = Link(spec, random.Random(link_seed))
        self._peers_on_segment = [
            [j for j in range(n) if j != i and topology.same_segment(self.hosts[i], self.hosts[j])]
            for i in range(n)
        ]

    def index(self, host: str) -> int:
        try:
            return self._index[host]
        except KeyError:
            raise ValueError(f"no host named {host!r}; hosts: {', '.join(self.hosts)}") from None

    def address(self, host: str) -> str:
        return str(host_address(self.network, self.index(host)))

    def route(self, now: float, src: int, packet: bytes) -> list[tuple[float, int]]:
        """Deliveries `(time, dst)` for a packet that host `src` sent at `now`."""
        length = len(packet)
        if length < 20 or packet[0] >> 4 != 4:
            self._unrouted[src].drop(NOT_IPV4, length)
            return []
        dst_addr = packet[16:20]
        if 0xE0 <= packet[16] <= 0xEF or dst_addr in self._broadcast:
            dests = self._peers_on_segment[src]
            if not dests:
                self._unrouted[src].drop(NO_ROUTE, length)
                return []
        else:
            dst = self._by_address.get(dst_addr)
            if dst is None or dst == src:
                self._unrouted[src].drop(NO_ROUTE, length)
                return []
            dests = (dst,)
        out = []
        links = self._links[src]
        for dst in dests:
            counters = self._counters[src][dst]
            link = links[dst]
            if link is None:
                counters.drop(NO_ROUTE, length)
                continue
            verdict = link.send(now, length)
            if isinstance(verdict, Drop):
                counters.drop(verdict.value, length)
                continue
            counters.packets += 1
            counters.bytes += length
            out.append((verdict, dst))
        return out

    def _link(self, src: str, dst: str) -> Link:
        link = self._links[self.index(src)][self.index(dst)]
        if link is None:
            raise ValueError(f"no link {src}>{dst} in this topology")
        return link

    def spec(self, src: str, dst: str) -> LinkSpec:
        return self._link(src, dst).spec

    def set_link(self, src: str, dst: str, spec: LinkSpec) -> None:
        """Replace the spec of the `src>dst` direction (which must exist)."""
        self._link(src, dst).set_spec(spec)

    def set_up(self, a: str, b: str, up: bool) -> None:
        """Partition (`up=False`) or heal both directions between `a` and `b`."""
        for src, dst in ((a, b), (b, a)):
            link = self._link(src, dst)
            link.set_spec(link.spec.replace(up=up))

    def counters(self) -> dict[str, Any]:
        """`links`: {"a>b": counters} for every pair that saw traffic or has a link;
        `unrouted`: {host: counters} for packets that had no destination host."""
        links = {}
        for i, a in enumerate(self.hosts):
            for j, b in enumerate(self.hosts):
                c = self._counters[i][j]
                if self._links[i][j] is not None or c.dropped:
                    links[f"{a}>{b}"] = c.to_dict()
        unrouted = {h: c.to_dict() for h, c in zip(self.hosts, self._unrouted, strict=True)}
        return {"links": links, "unrouted": unrouted}
