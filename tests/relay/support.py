"""Relay test helpers: agents (overlay + relay client) around one relay server."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.net.manager import ConnectionManager
from meshagent.net.transport import StreamHandler, Transport
from meshagent.relay.client import RelayClient
from meshagent.relay.limits import RelayLimits
from meshagent.relay.server import RelayServer
from meshagent.wire.handshake import LocalPeer
from tests.net.support import NetEnv, hash_exchange, hash_reply

MESH = MeshSecret(b"\x51" * 32)
OTHER = MeshSecret(b"\x52" * 32)


class Firewall(Transport):
    """A transport that refuses to dial hosts in `blocked` (no direct route to them)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.blocked: set[str] = set()

    async def dial(self, address: Address) -> trio.abc.Stream:
        if address.host in self.blocked:
            raise OSError(113, f"no route to host {address.host}")
        return await self.inner.dial(address)

    async def serve(self, address, handler: StreamHandler, *, task_status=trio.TASK_STATUS_IGNORED):
        await self.inner.serve(address, handler, task_status=task_status)


@dataclass
class Captured:
    chunks: list[tuple[bytes, str, bytes]] = field(default_factory=list)

    def __call__(self, circuit: bytes, direction: str, data: bytes) -> None:
        self.chunks.append((circuit, direction, data))

    @property
    def all_bytes(self) -> bytes:
        return b"".join(c[2] for c in self.chunks)


async def start_relay(
    env: NetEnv, nursery: trio.Nursery, limits: RelayLimits | None = None
) -> tuple[RelayServer, Address, Captured]:
    captured = Captured()
    server = RelayServer(
        env.transport("relay"), env.listen_address("relay"), limits, on_bytes=captured
    )
    address = await nursery.start(server.run)
    return server, address, captured


@dataclass
class RelayAgent:
    overlay: ConnectionManager
    client: RelayClient
    transport: Firewall
    identity: NodeIdentity

    @property
    def peer_id(self) -> str:
        return self.overlay.peer_id


async def start_agent(
    env: NetEnv,
    nursery: trio.Nursery,
    host: str,
    relay: Address,
    *,
    mesh: MeshSecret = MESH,
    register: bool = True,
    on_stream=hash_reply,
) -> RelayAgent:
    identity = NodeIdentity.generate()
    transport = Firewall(env.transport(host))
    overlay = ConnectionManager(
        LocalPeer.create(identity, mesh),
        transport,
        listen=[env.listen_address(host)],
        on_stream=on_stream,
        rng=random.Random(1),
    )
    await nursery.start(overlay.run)
    client = RelayClient(relay, identity, mesh, overlay, transport, timeout=5.0)
    if register:
        await nursery.start(client.run)
        with trio.fail_after(30):
            await client.wait_registered()
    return RelayAgent(overlay, client, transport, identity)


async def mesh_pairs(
    env: NetEnv, nursery: trio.Nursery, relay: Address, meshes: list[MeshSecret]
) -> list[tuple[RelayAgent, RelayAgent]]:
    """Two agents of each mesh, registered with the relay at `relay`."""
    pairs = []
    for i, mesh in enumerate(meshes):
        a = await start_agent(env, nursery, f"a{i}", relay, mesh=mesh)
        b = await start_agent(env, nursery, f"b{i}", relay, mesh=mesh)
        pairs.append((a, b))
    return pairs


async def push_through(pairs: list[tuple[RelayAgent, RelayAgent]], mib: int) -> dict[int, float]:
    """Each pair's first agent sends `mib` MiB to the second over a relay circuit, every pair
    at once; the seconds each took, by pair."""
    took: dict[int, float] = {}

    async def push(i: int, a: RelayAgent, b: RelayAgent) -> None:
        began = trio.current_time()
        await a.client.dial(b.peer_id)
        stream = await a.overlay.open_stream(b.peer_id, "bulk")
        await hash_exchange(stream, [bytes(1 << 20)] * mib)
        took[i] = trio.current_time() - began

    async with trio.open_nursery() as nursery:
        for i, (a, b) in enumerate(pairs):
            nursery.start_soon(push, i, a, b)
    return took
