"""The agent's view of a relay circuit: the transport stream, minus the relay's own
messages, plus any bytes that arrived together with SPLICED."""

from __future__ import annotations

import trio


class SplicedStream(trio.abc.HalfCloseableStream):
    def __init__(self, inner: trio.abc.Stream, leftover: bytes, *, remote: str) -> None:
        self._inner = inner
        self._leftover = leftover
        self.remote = remote

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def send_some(self, data: bytes | bytearray | memoryview) -> int:
        """Partial-progress send (what the overlay's record writer uses to stay
        cancellation-safe); falls back to a shielded send_all."""
        if isinstance(self._inner, trio.SocketStream):
            return await self._inner.socket.send(data)
        inner_send_some = getattr(self._inner, "send_some", None)
        if inner_send_some is not None:
            return await inner_send_some(data)
        with trio.CancelScope(shield=True):
            await self._inner.send_all(data)
        return len(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        send_eof = getattr(self._inner, "send_eof", None)
        if send_eof is not None:
            await send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._leftover:
            n = len(self._leftover) if max_bytes is None else max_bytes
            out, self._leftover = self._leftover[:n], self._leftover[n:]
            await trio.lowlevel.checkpoint()
            return out
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()
