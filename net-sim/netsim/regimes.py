"""Named network regimes and the topologies built from them.

A `Topology` says which hosts exist, which of them share a LAN segment (multicast such as mDNS
reaches each other) and, for each ordered pair of hosts, the `LinkSpec` of that direction. A pair
with no spec has no route: its packets are dropped, as between two machines behind different
NATs. An optional relay host can be reached from every host, so isolated hosts still meet there.

The regimes (one-way delay; jitter as a share of the delay; loss per packet; rate):

- `lan`: 0.5 ms, no jitter, no loss, 1 Gbit/s; every host on one segment.
- `wan`: 15 ms, 2 %, 0.1 %, 100 Mbit/s; every host on its own segment.
- `longhaul`: 75 ms, 1 %, 0.5 %, 50 Mbit/s; every host on its own segment.
- `mixed`: hosts 0 and 1 share a LAN segment (`lan` links between them); every other host is
  in another city, on its own segment, with `wan` links to all. Two machines at home and one
  a region away is the common case the mesh must serve well; `longhaul` alone covers the far
  case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from netsim.linkmodel import LinkSpec

MBIT = 1_000_000
GBIT = 1_000_000_000

LAN = LinkSpec(delay_s=0.0005, rate_bps=1 * GBIT)
WAN = LinkSpec.with_jitter_fraction(0.015, 0.02, loss=0.001, rate_bps=100 * MBIT)
LONGHAUL = LinkSpec.with_jitter_fraction(0.075, 0.01, loss=0.005, rate_bps=50 * MBIT)

SPECS: Mapping[str, LinkSpec] = {"lan": LAN, "wan": WAN, "longhaul": LONGHAUL}
REGIMES = ("lan", "wan", "longhaul", "mixed")
RELAY = "relay"


@dataclass(frozen=True)
class Topology:
    """Hosts (by name), their LAN segment (None: on no segment, so no multicast reaches or
    leaves them) and the spec of each directed link `(src, dst)`."""

    hosts: tuple[str, ...]
    segments: Mapping[str, str | None]
    links: Mapping[tuple[str, str], LinkSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"host names repeat: {self.hosts}")
        missing = set(self.hosts) - set(self.segments)
        if missing:
            raise ValueError(f"hosts without a segment entry: {sorted(missing)}")
        for a, b in self.links:
            if a not in self.hosts or b not in self.hosts or a == b:
                raise ValueError(f"link {a}>{b} does not join two hosts of the topology")

    def link(self, src: str, dst: str) -> LinkSpec | None:
        return self.links.get((src, dst))

    def same_segment(self, a: str, b: str) -> bool:
        sa = self.segments[a]
        return sa is not None and sa == self.segments[b]

    def with_link(self, a: str, b: str, spec: LinkSpec | None, *, both: bool = True) -> Topology:
        """A copy with `a>b` (and `b>a` unless `both` is False) set to `spec`; None removes
        the route."""
        links = dict(self.links)
        for pair in [(a, b), (b, a)] if both else [(a, b)]:
            if spec is None:
                links.pop(pair, None)
            else:
                links[pair] = spec
        return Topology(self.hosts, self.segments, links)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hosts": list(self.hosts),
            "segments": dict(self.segments),
            "links": [[a, b, spec.to_dict()] for (a, b), spec in self.links.items()],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        return cls(
            hosts=tuple(d["hosts"]),
            segments=dict(d["segments"]),
            links={(a, b): LinkSpec.from_dict(s) for a, b, s in d["links"]},
        )


def _mesh(hosts: Iterable[str], spec_of) -> dict[tuple[str, str], LinkSpec]:
    hosts = list(hosts)
    return {(a, b): spec_of(a, b) for a in hosts for b in hosts if a != b}


def topology(
    regime: str,
    n_hosts: int,
    *,
    relay: bool = False,
    isolated: bool = False,
    relay_spec: LinkSpec | None = None,
) -> Topology:
    """Hosts `h0..h{n-1}` linked as `regime` says. `relay` adds a host named `relay`, on no
    segment, linked to every host (by `relay_spec`, default the regime's wide-area spec).
    `isolated` removes every host-to-host route and segment, leaving only the relay."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")
    if n_hosts < 1:
        raise ValueError("a topology needs at least one host")
    if regime == "mixed" and n_hosts < 3:
        raise ValueError("the mixed regime needs at least 3 hosts (a LAN pair and a far host)")
    hosts = [f"h{i}" for i in range(n_hosts)]
    if regime == "lan":
        segments: dict[str, str | None] = dict.fromkeys(hosts, "lan0")
        links = _mesh(hosts, lambda a, b: LAN)
        wide = LAN
    elif regime == "mixed":
        segments = {h: ("lan0" if i < 2 else f"site{i}") for i, h in enumerate(hosts)}
        links = _mesh(hosts, lambda a, b: LAN if segments[a] == segments[b] else WAN)
        wide = WAN
    else:
        wide = SPECS[regime]
        segments = {h: f"site{i}" for i, h in enumerate(hosts)}
        links = _mesh(hosts, lambda a, b: wide)
    if isolated:
        links = {}
        segments = dict.fromkeys(hosts)
    if relay:
        spec = relay_spec or wide
        segments[RELAY] = None
        for h in hosts:
            links[(h, RELAY)] = spec
            links[(RELAY, h)] = spec
        hosts.append(RELAY)
    return Topology(tuple(hosts), segments, links)
