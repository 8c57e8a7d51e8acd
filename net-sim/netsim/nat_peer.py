"""A member of a mesh with only what reaching its peers takes, for the `nat` scenario's many
runs: the overlay, gossip of its addresses and NAT, its relays, the dialer with hole
punching, built from the agent's own modules as `meshagent up` builds them (no model, so it
starts in about a second). Every 0.2 s it writes where it stands to `--status` (JSON): its
peer id, its reachability, and per peer the path, when the connection opened and the
dialer's punch attempts and last error.

    python -m netsim.nat_peer --mesh HEX --listen 0.0.0.0:9338 --relay HOST:PORT --status F
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import trio

from meshagent.discovery import punch
from meshagent.discovery.dialer import DialerConfig, PeerDialer
from meshagent.discovery.reachable import Reachable
from meshagent.gossip import service as gossip_service
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.service import GossipService
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint
from meshagent.net.manager import ConnectionManager, LocalPeer
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.relay.client import RelayClient


async def main(args: argparse.Namespace) -> None:
    mesh = MeshSecret(bytes.fromhex(args.mesh))
    identity = NodeIdentity.generate()
    transport = TcpTransport()
    routes = {}

    async def route(stream: MeshStream) -> None:
        handler = routes.get(stream.label.split(":", 1)[0])
        if handler is None:
            stream.reset("no such service")
            return
        await handler(stream)

    overlay = ConnectionManager(
        LocalPeer.create(identity, mesh),
        transport,
        listen=[args.listen],
        on_stream=route,
        on_lost=lambda conn: dialer.lost(conn),
        on_silent=lambda conn: dialer.silent(conn),
    )
    reach = Reachable(lambda: overlay.listen_addresses, on_change=lambda: gossip.republish())
    relays = [
        RelayClient(
            r,
            identity,
            mesh,
            overlay,
            transport,
            on_member=lambda peer, relay: dialer.offer(
                peer, relays=(relay,), source="relay", renew=True
            ),
            on_observed=reach.observed,
        )
        for r in args.relay
    ]
    gossip = GossipService(
        identity,
        mesh_fingerprint(mesh),
        overlay,
        GossipConfig(),
        local_fields=lambda: {
            "addresses": tuple(reach.advertised()),
            "relays": tuple(r.name for r in relays if r.registered),
            "nat": reach.reachability().nat,
        },
    )
    dialer = PeerDialer(
        overlay,
        gossip=gossip,
        relay_dial=lambda relay, peer: next(r for r in relays if r.name == relay).dial(peer),
        local_relays=lambda: tuple(r.name for r in relays if r.registered),
        punch=punch.initiator(overlay, transport, reach),
        my_nat=lambda: reach.reachability().nat,
        relay_members=lambda: set().union(*(r.members for r in relays)),
        config=DialerConfig(),
    )
    routes[gossip_service.LABEL] = gossip.handle
    routes[punch.LABEL] = punch.server(overlay, transport, reach, dialer.behind_symmetric)
    status = Path(args.status)
    async with trio.open_nursery() as nursery:
        await nursery.start(overlay.run)
        await nursery.start(gossip.run)
        await nursery.start(dialer.run)
        for r in relays:
            await nursery.start(r.run)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(_write_status, status, identity.peer_id, overlay, dialer, reach)
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


async def _write_status(status: Path, peer_id, overlay, dialer, reach) -> None:
    began = time.time()
    while True:
        candidates = dialer.candidates()
        body = {
            "peer_id": peer_id,
            "started_at": began,
            "reachability": reach.reachability().to_dict(),
            "advertised": reach.advertised(),
            "peers": {
                link.peer_id: {
                    "path": link.path,
                    "remote": link.remote,
                    "punches": getattr(candidates.get(link.peer_id), "punches", 0),
                    "punch_error": getattr(candidates.get(link.peer_id), "punch_error", None),
                    "rtt_ms": None
                    if link.rtt.smoothed is None
                    else round(link.rtt.smoothed * 1000, 2),
                }
                for link in overlay.links()
            },
        }
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, status)
        await trio.sleep(0.2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", required=True, help="the mesh secret, hex")
    ap.add_argument("--listen", default="0.0.0.0:9338")
    ap.add_argument("--relay", action="append", default=[])
    ap.add_argument("--status", required=True)
    trio.run(main, ap.parse_args())
