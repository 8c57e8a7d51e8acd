"""Listener: accepts transport streams, authenticates each, hands connections onward."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
import trio

from meshagent.net.address import Address
from meshagent.net.config import OverlayConfig
from meshagent.net.secure import secure_handshake
from meshagent.net.transport import Transport
from meshagent.wire.errors import HandshakeError
from meshagent.wire.handshake import HandshakeResult, LocalPeer
from meshagent.wire.replay import ReplayGuard

log = structlog.get_logger(__name__)

# (transport stream, handshake result, bytes read past the handshake, printable remote)
ConnectionHandler = Callable[[trio.abc.Stream, HandshakeResult, bytes, str], Awaitable[None]]


class Listener:
    """Serves one address. A peer that fails the handshake (wrong mesh secret, replayed or
    tampered handshake, plaintext, timeout) is refused with a logged reason; one peer's
    failure, even an unexpected exception, never stops the listener serving others."""

    def __init__(
        self,
        transport: Transport,
        address: Address,
        local: LocalPeer,
        *,
        on_connection: ConnectionHandler,
        config: OverlayConfig | None = None,
        replay_guard: ReplayGuard | None = None,
    ) -> None:
        self._transport = transport
        self._address = address
        self._local = local
        self._on_connection = on_connection
        self._config = config or OverlayConfig()
        self._guard = replay_guard or ReplayGuard()
        # Bounds the tasks and buffers strangers can tie up before proving membership.
        self._handshakes = trio.CapacityLimiter(self._config.max_pending_handshakes)
        self.address: Address | None = None

    async def run(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(self._transport.serve, self._address, self._handle)
            log.info("listener.started", address=str(self.address), peer=self._local.peer_id)
            task_status.started(self.address)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        remote = Transport.remote_of(stream)
        try:
            self._handshakes.acquire_on_behalf_of_nowait(stream)
        except trio.WouldBlock:
            log.warning("handshake.refused", remote=remote, reason="too many pending handshakes")
            await trio.aclose_forcefully(stream)
            return
        try:
            authenticated = await self._authenticate(stream, remote)
        finally:
            self._handshakes.release_on_behalf_of(stream)
        if authenticated is None:
            return
        result, leftover = authenticated
        try:
            await self._on_connection(stream, result, leftover, remote)
        except Exception:
            log.exception("listener.peer_failed", remote=remote)
            await trio.aclose_forcefully(stream)

    async def _authenticate(
        self, stream: trio.abc.Stream, remote: str
    ) -> tuple[HandshakeResult, bytes] | None:
        try:
            return await secure_handshake(
                stream,
                self._local,
                initiator=False,
                timeout=self._config.handshake_timeout,
                replay_guard=self._guard,
            )
        except HandshakeError as e:
            reason = str(e)
        except Exception as e:  # a bug must not take the listener down with it
            log.exception("handshake.failed_unexpectedly", remote=remote)
            reason = f"internal error: {type(e).__name__}"
        log.warning("handshake.refused", remote=remote, listener=str(self.address), reason=reason)
        await trio.aclose_forcefully(stream)
        return None
