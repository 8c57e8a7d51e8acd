"""Test helpers for the overlay: environments, handlers, and misbehaving peers."""

from __future__ import annotations

import hashlib
from contextlib import asynccontextmanager
from dataclasses import replace

import trio

from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.net.config import OverlayConfig
from meshagent.net.manager import ConnectionManager
from meshagent.net.secure import secure_handshake
from meshagent.net.stream import MeshStream
from meshagent.net.tcp import TcpTransport
from meshagent.net.transport import Transport
from meshagent.testing.sim_network import LinkSpec, SimNetwork
from meshagent.wire.handshake import HandshakeResult, LocalPeer
from meshagent.wire.sealed_records import RecordSealer
from meshagent.wire.settings import StreamSettings

MESH = MeshSecret(b"\x42" * 32)
OTHER_MESH = MeshSecret(b"\x43" * 32)


def local_peer(mesh: MeshSecret = MESH, **settings) -> LocalPeer:
    return LocalPeer.create(
        NodeIdentity.generate(), mesh, settings=StreamSettings(**settings) if settings else None
    )


class NetEnv:
    """Either real TCP on 127.0.0.1 or one shared simulated network."""

    def __init__(self, kind: str, link: LinkSpec | None = None) -> None:
        self.kind = kind
        self.sim = SimNetwork(default=link or LinkSpec(latency=0.001)) if kind == "sim" else None

    def transport(self, host: str) -> Transport:
        return self.sim.transport(host) if self.sim is not None else TcpTransport()

    def listen_address(self, host: str) -> str:
        return f"{host}:0" if self.sim is not None else "127.0.0.1:0"


async def hash_reply(stream: MeshStream) -> None:
    """Read to EOF, reply with sha256 + byte count, half-close."""
    digest, total = hashlib.sha256(), 0
    while data := await stream.receive_some():
        digest.update(data)
        total += len(data)
    await stream.send_all(digest.digest() + total.to_bytes(8, "big"))
    await stream.send_eof()


async def read_all(stream: trio.abc.ReceiveStream) -> bytes:
    out = bytearray()
    while data := await stream.receive_some():
        out += data
    return bytes(out)


async def hash_exchange(stream: MeshStream, chunks: list[bytes]) -> None:
    """Send `chunks` to a hash_reply handler and check the reply."""
    expected = hashlib.sha256()
    for chunk in chunks:
        expected.update(chunk)
        await stream.send_all(chunk)
    await stream.send_eof()
    reply = await read_all(stream)
    assert reply == expected.digest() + sum(map(len, chunks)).to_bytes(8, "big")


@asynccontextmanager
async def node(env: NetEnv, host: str, nursery: trio.Nursery, *, listen=True, **kwargs):
    """A started ConnectionManager; yields (manager, listen address or None)."""
    local = kwargs.pop("local", None) or local_peer()
    kwargs.setdefault("on_stream", hash_reply)
    kwargs.setdefault("config", OverlayConfig())
    manager = ConnectionManager(
        local,
        env.transport(host),
        listen=[env.listen_address(host)] if listen else [],
        **kwargs,
    )
    addresses = await nursery.start(manager.run)
    yield manager, (addresses[0] if addresses else None)


def quick(config: OverlayConfig | None = None, **changes) -> OverlayConfig:
    return replace(config or OverlayConfig(), **changes)


async def honest_handshake(
    env: NetEnv, host: str, address: Address, local: LocalPeer
) -> tuple[trio.abc.Stream, HandshakeResult, RecordSealer]:
    """A raw client that completes a genuine handshake, then may send anything."""
    stream = await env.transport(host).dial(address)
    result, _ = await secure_handshake(stream, local, initiator=True, timeout=10)
    return stream, result, RecordSealer(result.send_key, result.cipher)


class Recorder(trio.abc.Stream):
    """Wraps a stream and records every byte sent through it (an eavesdropper's capture)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sent = bytearray()

    async def send_all(self, data) -> None:
        self.sent += data
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def wait_closed_by_peer(stream: trio.abc.Stream) -> None:
    """Read until the server closes on us (EOF or reset)."""
    try:
        while await stream.receive_some(65536):
            pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    await trio.aclose_forcefully(stream)


class TamperingProxy:
    """Forwards client -> server bytes, flipping one byte inside the client's first record
    after the handshake (two handshake messages with 2-byte lengths, then 4-byte records)."""

    def __init__(self, env: NetEnv, host: str, target: Address) -> None:
        self.env, self.host, self.target = env, host, target
        self.tampered = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        transport = self.env.transport(self.host)
        await transport.serve(
            Address.parse(self.env.listen_address(self.host)), self._handle, task_status=task_status
        )

    async def _handle(self, client: trio.abc.Stream) -> None:
        server = await self.env.transport(self.host).dial(self.target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, server, client, False, nursery)
            await self._pipe(client, server, True, nursery)

    async def _pipe(self, src, dst, tamper: bool, nursery: trio.Nursery) -> None:
        seen = bytearray()
        try:
            while data := await src.receive_some(65536):
                if tamper and not self.tampered:
                    start = len(seen)
                    seen += data
                    flip = self._flip_offset(seen)
                    if flip is not None and start <= flip < len(seen):
                        data = bytearray(data)
                        data[flip - start] ^= 0x20
                        self.tampered = True
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        nursery.cancel_scope.cancel()
        await trio.aclose_forcefully(src)
        await trio.aclose_forcefully(dst)

    @staticmethod
    def _flip_offset(seen: bytearray) -> int | None:
        pos = 0
        for _ in range(2):  # handshake messages 1 and 3
            if len(seen) < pos + 2:
                return None
            pos += 2 + int.from_bytes(seen[pos : pos + 2], "big")
        return pos + 4 + 3  # a byte inside the first record's ciphertext
