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
        self.address: Address | None = None

    async def run(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self.address = await nursery.start(self._transport.serve, self._address, self._handle)
            log.info("listener.started", address=str(self.address), peer=self._local.peer_id)
            task_status.started(self.address)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        remote = Transport.remote_of(stream)
        try:
            try:
                result, leftover = await secure_handshake(
                    stream,
                    self._local,
                    initiator=False,
                    timeout=self._config.handshake_timeout,
                    replay_guard=self._guard,
                )
            except HandshakeError as e:
                log.warning(
                    "handshake.refused",
                    remote=remote,
                    listener=str(self.address),
                    reason=str(e),
                )
                await trio.aclose_forcefully(stream)
                return
            await self._on_connection(stream, result, leftover, remote)
        except Exception:
            log.exception("listener.peer_failed", remote=remote)
            await trio.aclose_forcefully(stream)
