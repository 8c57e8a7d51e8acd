"""A scripted trio stream for tests of code that reads and writes whole protocol exchanges:
it delivers given chunks (then EOF) and records everything sent."""

from __future__ import annotations

import trio


class ScriptedStream(trio.abc.HalfCloseableStream):
    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.sent = bytearray()
        self.eof_sent = False
        self.receive_sizes: list[int | None] = []

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        self.receive_sizes.append(max_bytes)
        if not self.chunks:
            return b""
        chunk = self.chunks.pop(0)
        if max_bytes is not None and len(chunk) > max_bytes:
            self.chunks.insert(0, chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        return chunk

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        self.sent += data

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        self.eof_sent = True

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
