"""MeshStream: one multiplexed stream, used like any trio stream."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from meshagent.net.errors import StreamResetError
from meshagent.wire.errors import ErrorCode

if TYPE_CHECKING:
    from meshagent.net.connection import Connection

DEFAULT_RECEIVE = 256 * 1024


class MeshStream(trio.abc.HalfCloseableStream):
    """A stream over an overlay connection.

    `send_all` waits while the peer has granted no credit, however long that takes: no
    timeout, no reset. `receive_some` returns b"" after the peer's `send_eof`. A reset (by
    the peer, or when the connection ends) raises StreamResetError from both.
    """

    def __init__(self, conn: Connection, stream_id: int, label: str) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.label = label
        self._error: StreamResetError | None = None
        self._closed = False
        self._eof_sent = False
        self._sending = False
        self._receiving = False
        self._readable = trio.Event()
        self._writable = trio.Event()

    @property
    def peer_id(self) -> str:
        return self._conn.peer_id

    @property
    def connection(self) -> Connection:
        return self._conn

    # ----- called by the connection -----

    def _wake_reader(self) -> None:
        self._readable.set()

    def _wake_writer(self) -> None:
        self._writable.set()

    def _fail(self, error: StreamResetError) -> None:
        if self._error is None:
            self._error = error
        self._readable.set()
        self._writable.set()

    def _check_send(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream was closed locally")
        if self._error is not None:
            raise self._error
        if self._eof_sent:
            raise trio.ClosedResourceError("send_eof() was already called on this stream")

    # ----- trio stream API -----

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send everything. A cancellation point, but it yields to other tasks only while it
        waits (for credit, or for the socket to take more): a message the socket takes at
        once costs no scheduler pass, which is a good part of a small round trip."""
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            view = memoryview(data).cast("B")
            while view:
                self._check_send()
                n = self._conn._send(self.stream_id, view)
                if n:
                    view = view[n:]
                    await self._conn._send_inline()
                    continue
                self._writable = trio.Event()
                await self._writable.wait()
        finally:
            self._sending = False

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the peer's credit allows now, without waiting (for code on the event
        loop that cannot: a callback). Returns how many bytes were taken; the caller sends
        the rest, in order, with `send_all`. Raises what `send_all` raises."""
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._check_send()
        n = self._conn._send(self.stream_id, memoryview(data).cast("B"))
        if n:
            self._conn._write_now()
        return n

    async def wait_send_all_might_not_block(self) -> None:
        self._check_send()
        while self._conn.mux.send_credit(self.stream_id)[0] == 0:
            self._writable = trio.Event()
            await self._writable.wait()
            self._check_send()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """The next bytes from the peer (at most one DATA frame's worth), b"" at EOF."""
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("stream was closed locally")
                if self._error is not None:
                    raise self._error
                data = self._conn._read(self.stream_id, max_bytes or DEFAULT_RECEIVE)
                if data is not None:
                    if not waited:
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    return data
                self._readable = trio.Event()
                await self._conn._read_for(self)
                waited = True
        finally:
            self._receiving = False

    async def send_eof(self) -> None:
        """Half-close: the peer reads EOF after everything sent so far."""
        if self._closed:
            raise trio.ClosedResourceError("stream was closed locally")
        if self._error is not None:
            raise self._error
        if not self._eof_sent:
            self._eof_sent = True
            self._conn._send_eof(self.stream_id)
            await self._conn._send_inline()
        await trio.lowlevel.checkpoint()

    def reset(self, reason: str = "reset by the application", code=ErrorCode.CANCEL) -> None:
        """Abort both directions now; the peer's operations raise StreamResetError(reason)."""
        if self._error is None and not self._closed:
            self._conn._reset(self.stream_id, code, reason)
            self._fail(StreamResetError(self.stream_id, code, reason, by_peer=False))

    async def aclose(self) -> None:
        """Finish the stream: half-close if the peer already finished sending, otherwise
        reset it with CANCEL (the peer learns we stopped reading)."""
        if not self._closed:
            if self._error is None:
                if self._conn.mux.is_remote_open(self.stream_id):
                    self._conn._reset(self.stream_id, ErrorCode.CANCEL, "closed by the application")
                elif not self._eof_sent:
                    self._eof_sent = True
                    self._conn._send_eof(self.stream_id)
            self._closed = True
            self._conn._forget(self.stream_id)
        await trio.lowlevel.checkpoint()
