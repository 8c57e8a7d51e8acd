"""A member of a running agent's mesh, for tests and benchmarks that speak to it as a peer.

`Member` joins with the agent's mesh secret under an identity of its own (fresh unless given)
and opens overlay streams to it by label, as any member of the mesh may: the starting point
of the hostile member (`testing/hostile.py`) and of every test that sends a peer message.
Streams the agent opens to the member (its gossip exchanges) go to `on_stream` where one is
given, and are refused otherwise.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from meshagent.config import DataDir
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.identity.mesh_file import load_mesh
from meshagent.net.config import OverlayConfig
from meshagent.net.connection import Connection, StreamAcceptor
from meshagent.net.manager import ConnectionManager
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.wire.handshake import LocalPeer


@dataclass(frozen=True)
class AgentAddress:
    """Where a running agent's overlay listens, and who it is (from its run file)."""

    peer_id: str
    overlay: str
    mesh: MeshSecret

    @classmethod
    def of(cls, data_dir: Path) -> AgentAddress:
        dd = DataDir(data_dir)
        info = json.loads(dd.run_path.read_text())
        return cls(info["peer_id"], info["listen"][0], load_mesh(dd.mesh_path))


class Member:
    """One connection to an agent, as a member of its mesh; streams opened by label."""

    def __init__(self, node: ConnectionManager, conn: Connection, agent: AgentAddress) -> None:
        self.node = node
        self.conn = conn
        self.agent = agent

    @property
    def peer_id(self) -> str:
        return self.node.peer_id

    async def open(self, label: str, **window: int) -> MeshStream:
        """Open a stream labelled `label` to the agent."""
        return await self.conn.open_stream(label, **window)

    async def redial(self) -> Connection:
        """Connect again after the agent closed the connection (the same identity); raises
        `DialError` where the agent cannot be reached (`config.dial_backoff` says how hard
        it tries)."""
        if self.conn.is_closed:
            self.conn = await self.node.dial(self.agent.overlay, peer_id=self.agent.peer_id)
        return self.conn

    @classmethod
    @asynccontextmanager
    async def join(
        cls,
        agent: AgentAddress,
        *,
        identity: NodeIdentity | None = None,
        on_stream: StreamAcceptor | None = None,
        config: OverlayConfig | None = None,
    ) -> AsyncIterator[Member]:
        """Connect to `agent` with its mesh secret; the connection ends with the block.
        Streams the agent opens go to `on_stream` (none: refused). A failed dial raises its
        `DialError`, and an error of the block comes out as it is, not in a group."""
        local = LocalPeer.create(identity or NodeIdentity.generate(), agent.mesh)
        node = ConnectionManager(local, TcpTransport(), on_stream=on_stream, config=config)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                try:
                    conn = await node.dial(agent.overlay, peer_id=agent.peer_id)
                    yield cls(node, conn, agent)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await node.aclose(grace=0.5)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
