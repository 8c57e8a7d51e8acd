"""Writing sealed records to a transport without ever corrupting the record stream."""

from __future__ import annotations

import socket

import trio

from meshagent.wire.mux import Multiplexer
from meshagent.wire.sealed_records import RecordSealer


class RecordWriter:
    """Seals queued frames and writes them in batches.

    Every sealed record consumes a nonce, so sealed bytes must reach the wire in order, in
    full. On a socket we write without blocking (`sock`, a non-blocking duplicate of the
    connection's socket) and wait for it to be writable only when the kernel takes nothing;
    on the simulated network we use its `send_some`. Both report how much they took and are
    cancelled only before taking anything: whatever a cancelled write leaves behind stays
    queued for the next write, so no shield is needed and application tasks may write
    inline. A write the socket takes at once does not yield to other tasks (that costs a
    whole scheduler pass per message); waiting for the socket does. Transports that cannot
    report partial progress get shielded writes instead.

    A batch is sealed into a buffer kept for the connection's life and reused once the
    transport has taken all of it: a fresh megabyte per batch costs more in page faults
    than the encryption itself. It grows to about `batch` plus one record.
    """

    def __init__(
        self,
        transport: trio.abc.Stream,
        sealer: RecordSealer,
        batch: int,
        sock: socket.socket | None = None,
    ) -> None:
        self._transport = transport
        self._sock = sock
        self._send_some = None
        if sock is None:  # e.g. SimStream; any stream offering send_some(data) -> int
            self._send_some = getattr(transport, "send_some", None)
        self._sealer = sealer
        self._batch = batch
        self._buffer = bytearray()
        self._pending = memoryview(self._buffer)  # sealed, not yet taken by the transport
        self.bytes_sent = 0

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    async def write(self, mux: Multiplexer) -> None:
        """Write until neither sealed bytes nor queued frames remain. Raises the transport's
        errors (OSError, trio.BrokenResourceError, trio.ClosedResourceError)."""
        while True:
            pending = self._pending
            if not pending:
                if not mux.has_output:
                    return
                pending = self._pending = self._seal(mux)
            if self._sock is not None:
                try:
                    sent = self._sock.send(pending)
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_writable(self._sock)
                    continue
            elif self._send_some is not None:
                sent = await self._send_some(pending)
            else:
                with trio.CancelScope(shield=True):
                    await self._transport.send_all(pending)
                sent = len(pending)
            self._pending = pending[sent:]
            self.bytes_sent += sent

    def write_nowait(self, mux: Multiplexer) -> bool:
        """Write what the socket takes now, without waiting; True when nothing is left.
        Transports other than a socket are written by `write` only (returns False)."""
        if self._sock is None:
            return not self._pending and not mux.has_output
        while True:
            pending = self._pending
            if not pending:
                if not mux.has_output:
                    return True
                pending = self._pending = self._seal(mux)
            try:
                sent = self._sock.send(pending)
            except (BlockingIOError, InterruptedError):
                return False
            self._pending = pending[sent:]
            self.bytes_sent += sent

    def _seal(self, mux: Multiplexer) -> memoryview:
        frames = mux.frames_to_seal(self._batch)
        size = self._sealer.sealed_size(frames)
        if len(self._buffer) < size:
            # A new buffer rather than a resize: the old one may still be exported to a view.
            self._buffer = bytearray(max(size, 2 * len(self._buffer)))
        written = self._sealer.seal_into(frames, self._buffer)
        return memoryview(self._buffer)[:written]
