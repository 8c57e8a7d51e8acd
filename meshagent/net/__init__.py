"""The overlay's trio side: transports (TCP; a simulated one is in `meshagent.testing`),
connections, listener, manager.

Code here only moves bytes and events between sockets and the sans-IO state machines in
`meshagent.wire`. See docs/protocol.md for the protocol itself. Typical use:

    local = LocalPeer.create(identity, mesh_secret)
    manager = ConnectionManager(local, TcpTransport(), listen=["0.0.0.0:7070"],
                                on_stream=handle)          # async def handle(stream)
    addresses = await nursery.start(manager.run)
    await manager.dial("10.0.0.2:7070", peer_id=...)
    stream = await manager.open_stream(peer_id, "stage")    # a trio HalfCloseableStream
"""

from meshagent.net.address import Address
from meshagent.net.config import OverlayConfig
from meshagent.net.connection import DIRECT, RELAYED, Connection
from meshagent.net.errors import (
    ConnectionUnavailable,
    DialError,
    HandshakeInterrupted,
    StreamResetError,
)
from meshagent.net.manager import ConnectionManager, PeerLink
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.net.transport import Transport

__all__ = [
    "DIRECT",
    "RELAYED",
    "Address",
    "Connection",
    "ConnectionManager",
    "ConnectionUnavailable",
    "DialError",
    "HandshakeInterrupted",
    "MeshStream",
    "OverlayConfig",
    "PeerLink",
    "StreamResetError",
    "TcpTransport",
    "Transport",
]
