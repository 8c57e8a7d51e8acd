"""mDNS for one agent, or the reason it is off.

Whether mDNS runs is decided once the overlay listens (its port may be the system's choice):
it is off when configured off, when the overlay listens on loopback only (nothing off this host
could dial what it would advertise), or when no interface has an IPv4 address. zeroconf
failing later is noted here and does not stop the agent.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import trio

from meshagent.discovery import addresses
from meshagent.discovery.mdns import MdnsDiscovery, Sighting
from meshagent.net.address import Address

log = structlog.get_logger(__name__)


class LanDiscovery:
    def __init__(
        self,
        *,
        enabled: bool,
        peer_id: str,
        mesh: str,
        name: str,
        listening: Callable[[], list[Address]],
        on_peer: Callable[[Sighting], None],
    ) -> None:
        """`listening`: the overlay's listen addresses; `on_peer`: called for every sighting
        of a member of our mesh."""
        self.enabled = enabled
        self.peer_id = peer_id
        self.mesh = mesh
        self.name = name
        self._listening = listening
        self._on_peer = on_peer
        self.note = "not started" if enabled else "disabled by configuration"
        # The running discovery: none until `run` starts it, and none while mDNS is off.
        self.mdns: MdnsDiscovery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start once the overlay listens; returns at once if mDNS is off."""
        self.mdns = self._discovery()
        task_status.started()
        if self.mdns is None:
            return
        try:
            await self.mdns.run()
        except Exception as e:  # zeroconf failing must not take the agent down
            self.note = f"failed: {type(e).__name__}: {e}"
            log.warning("mdns.failed", error=self.note)

    def _discovery(self) -> MdnsDiscovery | None:
        if not self.enabled:
            return None
        listen = self._listening()
        if addresses.is_loopback_only(listen):
            return self._off("off: the overlay listens on loopback only")
        hosts = [a.host for a in listen if a.host not in ("0.0.0.0", "::", "")]
        interfaces = hosts or addresses.interface_ipv4s()
        if not interfaces:
            return self._off("off: no network interface with an IPv4 address")
        self.note = "running"
        return MdnsDiscovery(
            peer_id=self.peer_id,
            mesh=self.mesh,
            port=listen[0].port,
            name=self.name,
            interfaces=interfaces,
            on_peer=self._on_peer,
        )

    def _off(self, note: str) -> None:
        self.note = note
        log.info("mdns.off", reason=note)
