"""Writing sealed records to a transport without ever corrupting the record stream."""

from __future__ import annotations

from collections import deque

import trio

from meshagent.wire.mux import Multiplexer
from meshagent.wire.records import RecordSealer


class RecordWriter:
    """Seals queued frames and writes them in batches.

    Every sealed record consumes a nonce, so sealed bytes must reach the wire in order, in
    full. On a trio SocketStream we write with `socket.send` (on the simulated network with
    its `send_some`), which reports how much it took and is cancelled only before taking
    anything: whatever a cancelled write leaves behind stays queued for the next write, so
    no shield is needed and application tasks may write inline. Transports that cannot
    report partial progress get shielded writes instead.
    """

    def __init__(self, transport: trio.abc.Stream, sealer: RecordSealer, batch: int) -> None:
        self._transport = transport
        if isinstance(transport, trio.SocketStream):
            self._send_some = transport.socket.send
        else:  # e.g. SimStream; any stream offering send_some(data) -> int
            self._send_some = getattr(transport, "send_some", None)
        self._sealer = sealer
        self._batch = batch
        self._sealed: deque[memoryview] = deque()  # sealed, not yet taken by the transport
        self._sealed_bytes = 0
        self.bytes_sent = 0

    @property
    def has_pending(self) -> bool:
        return bool(self._sealed)

    async def write(self, mux: Multiplexer) -> None:
        """Write until neither sealed bytes nor queued frames remain. Raises the transport's
        errors (OSError, trio.BrokenResourceError, trio.ClosedResourceError)."""
        sealed = self._sealed
        while sealed or mux.has_output:
            # Seal the next batch before the transport makes us wait, so that when it wants
            # more there is no pause for encryption (keeps the receiver busy).
            while mux.has_output and self._sealed_bytes < self._batch:
                buf = self._sealer.seal_many(mux.frames_to_send(self._batch))
                sealed.append(memoryview(buf))
                self._sealed_bytes += len(buf)
            head = sealed[0]
            if self._send_some is not None:
                sent = await self._send_some(head)
            else:
                with trio.CancelScope(shield=True):
                    await self._transport.send_all(head)
                sent = len(head)
            if sent == len(head):
                sealed.popleft()
            else:
                sealed[0] = head[sent:]
            self._sealed_bytes -= sent
            self.bytes_sent += sent
