"""What stands between this agent and the internet, from where others see it come from.

A relay says, in its HELLO, the address it sees a connection come from; its second port (the
observing port) says the same. The agent dials both from the port it listens on, so what they
see is how its NAT maps that port:

- seen at one of this host's own addresses, at the port dialed from: **no NAT** (`none`); the
  listen address is reachable as it is (a firewall may still drop what comes in);
- the same public address from two destinations: the NAT maps **independently of the
  destination** (`independent`, a "cone"): the public address works for every peer, and a hole
  punched toward one peer from it lets that peer in;
- two public addresses: the NAT maps **by destination** (`dependent`, "symmetric"): the
  public port is new for every peer and cannot be told ahead; only the public host helps
  (a peer whose NAT filters by host alone, or none, can still be reached);
- one observation only: `unknown`, the public address as seen.

Sans-IO: `Observations` takes what relays report and says what to advertise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from meshagent.net.address import Address

NONE = "none"
INDEPENDENT = "independent"
DEPENDENT = "dependent"
UNKNOWN = "unknown"
KINDS = (NONE, INDEPENDENT, DEPENDENT, UNKNOWN)
# What `meshagent status` and `peers` print for each kind.
SAID = {
    NONE: "no NAT",
    INDEPENDENT: "NAT, same public port for every peer (cone)",
    DEPENDENT: "NAT, a new public port for every peer (symmetric)",
    UNKNOWN: "not known yet",
}


@dataclass(frozen=True)
class Observation:
    observer: Address  # where we dialed
    local: Address  # our end of that connection
    seen: Address  # where the observer saw it come from


@dataclass(frozen=True)
class Reachability:
    nat: str  # one of KINDS
    public: tuple[str, ...]  # host:port others may dial (the NAT's mapping of our port)
    public_hosts: tuple[str, ...] = ()  # our public IPs, whatever the port

    def to_dict(self) -> dict[str, object]:
        return {
            "nat": self.nat,
            "said": SAID[self.nat],
            "public": list(self.public),
            "public_hosts": list(self.public_hosts),
        }


@dataclass
class Observations:
    """The latest observation from each observer (relay port), of connections dialed from
    the listen port."""

    own_hosts: Callable[[], Iterable[str]]  # this host's addresses
    _by_observer: dict[Address, Observation] = field(default_factory=dict)

    def add(self, o: Observation) -> bool:
        """Take an observation; says whether what is known changed."""
        old = self._by_observer.get(o.observer)
        self._by_observer[o.observer] = o
        return old != o

    def forget(self, observer: Address) -> None:
        self._by_observer.pop(observer, None)

    def reachability(self, listen_port: int) -> Reachability:
        mine = [o for o in self._by_observer.values() if o.local.port == listen_port]
        if not mine:
            return Reachability(UNKNOWN, ())
        own = set(self.own_hosts())
        if any(o.seen.host in own and o.seen.port == o.local.port for o in mine):
            return Reachability(NONE, ())
        seen = sorted({o.seen for o in mine})
        hosts = tuple(sorted({s.host for s in seen}))
        if len(seen) > 1:
            return Reachability(DEPENDENT, (), hosts)
        public = (str(seen[0]),)
        if len({o.observer for o in mine}) > 1:
            return Reachability(INDEPENDENT, public, hosts)
        return Reachability(UNKNOWN, public, hosts)
