"""mDNS discovery on the local network: advertise `_meshagent._tcp.local.` and browse it.

The advertisement carries our peer id, overlay port and mesh fingerprint (a one-way hash:
never the secret). Members of our mesh that we see are handed to `on_peer` (the dialer);
services of other meshes are remembered (for `meshagent status`) and otherwise ignored.

zeroconf runs its own thread. Its callbacks only queue events into trio with
`TrioToken.run_sync_soon` (never blocking either side), and every blocking zeroconf call
(start, register, resolve, close) runs in `trio.to_thread`.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import trio
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from meshagent.net.address import Address

log = structlog.get_logger(__name__)

SERVICE_TYPE = "_meshagent._tcp.local."
TXT_VERSION = "1"
_RESOLVE_MS = 3000
_QUEUE = 256


@dataclass(frozen=True)
class Sighting:
    """One agent seen on mDNS."""

    peer_id: str
    mesh: str
    addresses: tuple[str, ...]
    name: str
    same_mesh: bool
    seen_at: float  # wall clock

    def to_dict(self) -> dict[str, object]:
        return {
            "peer_id": self.peer_id,
            "name": self.name,
            "mesh": self.mesh,
            "same_mesh": self.same_mesh,
            "addresses": list(self.addresses),
            "seen_at": self.seen_at,
        }


class MdnsDiscovery:
    def __init__(
        self,
        *,
        peer_id: str,
        mesh: str,
        port: int,
        name: str,
        interfaces: list[str],
        on_peer: Callable[[Sighting], None],
    ) -> None:
        """`interfaces`: the IPv4 addresses to advertise and browse on (our listen
        addresses); `on_peer`: called in trio for every sighting of a member of our mesh."""
        self.peer_id = peer_id
        self.mesh = mesh
        self.port = port
        self.name = name
        self.interfaces = interfaces
        self._on_peer = on_peer
        self.sightings: dict[str, Sighting] = {}
        self.registered = False
        self.error: str | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[tuple[str, ServiceStateChange]](_QUEUE)

        def queue(item: tuple[str, ServiceStateChange]) -> None:  # runs in trio
            try:
                send.send_nowait(item)
            except trio.WouldBlock:
                log.warning("mdns.queue_full", dropped=item[0])

        def on_change(zeroconf, service_type, name, state_change) -> None:  # zeroconf thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(queue, (name, state_change))

        info = ServiceInfo(
            SERVICE_TYPE,
            f"{self.peer_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(ip) for ip in self.interfaces],
            port=self.port,
            properties={
                "v": TXT_VERSION,
                "id": self.peer_id,
                "mesh": self.mesh,
                "name": self.name[:63],
            },
            server=f"{self.peer_id}.local.",
        )
        zc = await trio.to_thread.run_sync(
            lambda: Zeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        )
        browser: ServiceBrowser | None = None
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                nursery.start_soon(self._register, zc, info)
                browser = await trio.to_thread.run_sync(
                    lambda: ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
                )
                log.info("mdns.browsing", interfaces=self.interfaces, port=self.port)
                async for name, change in receive:
                    if change is ServiceStateChange.Removed:
                        log.debug("mdns.removed", service=name)
                        continue
                    nursery.start_soon(self._resolve, zc, name)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await trio.to_thread.run_sync(self._shutdown, zc, browser, info)

    async def _register(self, zc: Zeroconf, info: ServiceInfo) -> None:
        try:
            await trio.to_thread.run_sync(zc.register_service, info, abandon_on_cancel=True)
            self.registered = True
            log.info("mdns.advertised", service=info.name, addresses=self.interfaces)
        except Exception as e:  # zeroconf raises its own types (NonUniqueNameException...)
            self.error = f"{type(e).__name__}: {e}"
            log.warning("mdns.advertise_failed", error=self.error)

    async def _resolve(self, zc: Zeroconf, name: str) -> None:
        info = await trio.to_thread.run_sync(
            zc.get_service_info, SERVICE_TYPE, name, _RESOLVE_MS, abandon_on_cancel=True
        )
        if info is None:
            log.debug("mdns.unresolved", service=name)
            return
        sighting = self._parse(info)
        if sighting is None or sighting.peer_id == self.peer_id:
            return
        known = self.sightings.get(sighting.peer_id)
        self.sightings[sighting.peer_id] = sighting
        if not sighting.same_mesh:
            if known is None:
                log.info(
                    "mdns.refused",
                    peer=sighting.peer_id,
                    name=sighting.name,
                    reason=f"advertises another mesh ({sighting.mesh}); not dialed",
                )
            return
        if known is None or known.addresses != sighting.addresses:
            log.info("mdns.found", peer=sighting.peer_id, addresses=list(sighting.addresses))
        self._on_peer(sighting)

    def _parse(self, info: ServiceInfo) -> Sighting | None:
        props = {
            (k.decode(errors="replace") if isinstance(k, bytes) else str(k)): (
                v.decode(errors="replace") if isinstance(v, bytes) else ""
            )
            for k, v in (info.properties or {}).items()
        }
        peer, mesh = props.get("id", ""), props.get("mesh", "")
        if props.get("v") != TXT_VERSION or not 0 < len(peer) <= 64 or not info.port:
            log.debug("mdns.malformed", service=info.name, properties=props)
            return None
        addresses = tuple(
            str(Address(ip, info.port)) for ip in info.parsed_addresses(IPVersion.V4Only)
        )
        return Sighting(
            peer_id=peer,
            mesh=mesh,
            addresses=addresses,
            name=props.get("name", ""),
            same_mesh=mesh == self.mesh,
            seen_at=round(time.time(), 3),
        )

    @staticmethod
    def _shutdown(zc: Zeroconf, browser: ServiceBrowser | None, info: ServiceInfo) -> None:
        if browser is not None:
            browser.cancel()
        # Best effort: the goodbye packet is a courtesy; zeroconf raises its own types.
        with contextlib.suppress(Exception):
            zc.unregister_service(info)
        zc.close()
