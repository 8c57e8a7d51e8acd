"""Agents on one simulated network, each an overlay, gossip and a dialer (no models, no HTTP):
for the gossip tests and `bench/gossip.py`."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from meshagent.discovery import hearing
from meshagent.discovery.dialer import DialerConfig, PeerDialer
from meshagent.discovery.keep import KeepConfig
from meshagent.gossip import swim_service
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.failure import PeerState
from meshagent.gossip.membership import Membership
from meshagent.gossip.service import LABEL, GossipService
from meshagent.gossip.swim import SwimConfig
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.testing.sim_network import SimNetwork
from meshagent.wire.handshake import LocalPeer

SECRET = MeshSecret(b"\x17" * 32)


@dataclass
class SimAgent:
    name: str
    overlay: ConnectionManager
    gossip: Membership
    dialer: PeerDialer
    scope: trio.CancelScope

    @property
    def peer_id(self) -> str:
        return self.overlay.peer_id

    def alive_view(self) -> set[str]:
        return {p for p, v in self.gossip.snapshot().items() if v.state is not PeerState.DEAD}


async def start_sim_agent(
    nursery: trio.Nursery,
    net: SimNetwork,
    name: str,
    *,
    gossip_config: GossipConfig | None = None,
    seed: int = 0,
    identity: NodeIdentity | None = None,
    port: int = 0,
    serve_gossip: Callable[[MeshStream], Awaitable[None]] | None = None,
    membership: str = "heartbeat",
    swim_config: SwimConfig | None = None,
    keep: KeepConfig | None = None,
) -> SimAgent:
    """An agent named `name` on `net`; `serve_gossip` answers its inbound `gossip/1` streams
    in place of its gossip service (a hostile member's, say). `membership`: "swim" runs
    membership by probes (`swim_service`) instead of the heartbeat protocol, with connections
    to the set of members `keep` bounds (`discovery/keep.py`)."""
    identity = identity or NodeIdentity.generate()
    handlers = {}

    async def route(stream):
        handler = handlers.get(stream.label.partition(":")[0])
        if handler is None:
            stream.reset("no service")
            return
        await handler(stream)

    scope = trio.CancelScope()
    ready = trio.Event()
    agent: list[SimAgent] = []
    overlay = ConnectionManager(
        LocalPeer.create(identity, SECRET),
        net.transport(name),
        listen=[f"{name}:{port}"],
        on_stream=route,
        on_lost=lambda conn: agent[0].dialer.lost(conn) if agent else None,
        on_silent=lambda conn: agent[0].dialer.silent(conn) if agent else None,
        rng=random.Random(seed),
    )

    async def serve():
        with scope:
            async with trio.open_nursery() as inner:
                addresses = await inner.start(overlay.run)
                fields = lambda: {"addresses": tuple(str(a) for a in addresses)}  # noqa: E731
                gossip: Membership
                if membership == "swim":
                    gossip = swim_service.SwimService(
                        identity,
                        SECRET.fingerprint,
                        overlay,
                        swim_config,
                        local_fields=fields,
                        rng=random.Random(seed + 1),
                        keep=keep,
                    )
                    handlers[swim_service.LABEL] = serve_gossip or gossip.handle
                else:
                    gossip = GossipService(
                        identity,
                        SECRET.fingerprint,
                        overlay,
                        gossip_config,
                        local_fields=fields,
                        rng=random.Random(seed + 1),
                    )
                    handlers[LABEL] = serve_gossip or gossip.handle
                handlers[hearing.LABEL] = partial(hearing.serve, overlay)
                dialer = PeerDialer(
                    overlay, gossip=gossip, config=DialerConfig(), rng=random.Random(seed + 2)
                )
                await inner.start(gossip.run)
                await inner.start(dialer.run)
                agent.append(SimAgent(name, overlay, gossip, dialer, scope))
                ready.set()

    nursery.start_soon(serve)
    await ready.wait()
    return agent[0]


async def crash_until_dead_everywhere(victim: SimAgent, rest: list[SimAgent]) -> float:
    """Stop `victim` as a crash would and wait (15 s at most) until every agent of `rest`
    holds it dead; the seconds that took."""
    victim.scope.cancel()
    began = trio.current_time()
    with trio.fail_after(15):
        while not all(
            x.gossip.snapshot(include_dead=True)[victim.peer_id].state is PeerState.DEAD
            for x in rest
        ):
            await trio.sleep(0.05)
    return trio.current_time() - began
