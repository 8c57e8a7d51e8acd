"""How peers can reach this agent: the addresses its record carries, its NAT as its relays
see it (`nat.py`), and the candidates it gives a peer that punches toward it (`punch.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from meshagent.discovery import addresses, nat
from meshagent.net.address import Address

log = structlog.get_logger(__name__)


class Reachable:
    def __init__(
        self,
        listening: Callable[[], Sequence[Address]],
        given: Sequence[str] = (),
        own_hosts: Callable[[], Sequence[str]] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`listening`: the overlay's listen addresses; `given`: `--address`es; `on_change`
        is called when what relays tell of us changes (to publish it at once)."""
        self._listening = listening
        self._on_change = on_change
        self.given = tuple(given)
        self.observations = nat.Observations(
            own_hosts=own_hosts or (lambda: addresses.interface_ipv4s(include_loopback=True))
        )

    def advertised(self) -> list[str]:
        """The overlay addresses this agent's record carries: `--address` first, then its
        listen addresses (a wildcard as each interface's), then its public address as relays
        see it where its NAT maps the listen port alike for every peer (or may)."""
        out = addresses.advertised(list(self._listening()), self.given)
        public = self.public_address()
        return [*out, public] if public and public not in out else out

    def punch_candidates(self) -> list[str]:
        """Where a peer punching toward us dials: what we advertise, and our public hosts at
        the listen port (behind a NAT that maps by destination the port is a guess, but a
        peer whose NAT filters by host alone lets us in from any port of that host)."""
        out = self.advertised()
        listen = self._listening()
        if listen:
            for host in self.reachability().public_hosts:
                a = str(Address(host, listen[0].port))
                if a not in out:
                    out.append(a)
        return out

    def spray_host(self) -> str | None:
        """Our public host where our NAT maps by destination (a peer punching with us then
        sprays its ports: `punch.SPRAY`)."""
        reach = self.reachability()
        return reach.public_hosts[0] if reach.nat == nat.DEPENDENT and reach.public_hosts else None

    def public_address(self) -> str | None:
        """Our public host:port where our NAT maps the listen port alike for every peer."""
        reach = self.reachability()
        ok = reach.nat in (nat.INDEPENDENT, nat.UNKNOWN)
        return reach.public[0] if ok and reach.public else None

    def reachability(self) -> nat.Reachability:
        """This agent's NAT and public address as its relays see them."""
        listen = self._listening()
        if not listen:
            return nat.Reachability(nat.UNKNOWN, ())
        return self.observations.reachability(listen[0].port)

    def observed(self, o: nat.Observation) -> None:
        """A relay said where it sees us come from (`RelayClient`'s `on_observed`)."""
        before = self.reachability()
        if self.observations.add(o):
            log.info(
                "nat.observed",
                observer=str(o.observer),
                local=str(o.local),
                seen=str(o.seen),
                nat=self.reachability().nat,
            )
            if self.reachability() != before and self._on_change is not None:
                self._on_change()
