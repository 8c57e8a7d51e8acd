"""MeshStream: one multiplexed stream, used like any trio stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio

from meshagent.net.errors import StreamResetError
from meshagent.wire.errors import ErrorCode

DEFAULT_RECEIVE = 256 * 1024


class StreamCarrier(Protocol):
    """What a stream asks of the connection it runs over (`net/connection.py`), by stream id.
    The connection calls back `wake_reader`, `wake_writer` and `fail` on its streams."""

    peer_id: str
    session_id: str
    path: str
    draining: bool  # it takes no new streams and closes once those open end

    def send_data(self, stream_id: int, view: memoryview) -> int:
        """Queue what credit allows of `view`; how many bytes were taken."""

    async def write_inline(self) -> None:
        """Write the queued frames from the calling task, or leave them to the writer task."""

    def write_now(self) -> None:
        """`write_inline` for code that cannot wait."""

    def has_send_credit(self, stream_id: int) -> bool: ...

    def read_data(self, stream_id: int, max_bytes: int) -> bytes | bytearray | None:
        """Received bytes (b"" at EOF), or None while there are none."""

    async def read_until(self, stream: MeshStream, ready: Callable[[], bool]) -> None:
        """While no other task reads the connection, read it from the calling task until
        `ready()`; the caller then waits for its stream's wake-up itself."""

    def send_eof(self, stream_id: int) -> None: ...

    def reset_stream(self, stream_id: int, code: ErrorCode, reason: str) -> None: ...

    def is_remote_open(self, stream_id: int) -> bool: ...

    def forget_stream(self, stream_id: int) -> None: ...


class MeshStream(trio.abc.HalfCloseableStream):
    """A stream over an overlay connection.

    `send_all` waits while the peer has granted no credit, however long that takes: no
    timeout, no reset. `receive_some` returns b"" after the peer's `send_eof`. A reset (by
    the peer, or when the connection ends) raises StreamResetError from both.
    """

    def __init__(self, conn: StreamCarrier, stream_id: int, label: str) -> None:
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
        self._on_ended: list[Callable[[], None]] = []

    @property
    def peer_id(self) -> str:
        return self._conn.peer_id

    @property
    def connection(self) -> StreamCarrier:
        """The connection it runs over."""
        return self._conn

    # ----- called by the connection -----

    def wake_reader(self) -> None:
        """Something arrived to read: data, EOF or a reset."""
        self._readable.set()

    def wake_writer(self) -> None:
        """The peer granted credit."""
        self._writable.set()

    def fail(self, error: StreamResetError) -> None:
        """The stream was reset (or its connection ended): every operation raises `error`."""
        if self._error is None:
            self._error = error
        self._readable.set()
        self._writable.set()
        self._ended()

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, as soon as the stream is over both ways here: our EOF
        queued after the peer's, a reset either way, or closed. Called before the peer can
        learn of it, so what it frees is free by the time the peer sees the stream end."""
        self._on_ended.append(callback)

    def _ended(self) -> None:
        callbacks, self._on_ended = self._on_ended, []
        for callback in callbacks:
            callback()

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
                n = self._conn.send_data(self.stream_id, view)
                if n:
                    view = view[n:]
                    await self._conn.write_inline()
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
        n = self._conn.send_data(self.stream_id, memoryview(data).cast("B"))
        if n:
            self._conn.write_now()
        return n

    async def wait_send_all_might_not_block(self) -> None:
        self._check_send()
        while not self._conn.has_send_credit(self.stream_id):
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
                data = self._conn.read_data(self.stream_id, max_bytes or DEFAULT_RECEIVE)
                if data is not None:
                    if not waited:
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    return data
                self._readable = trio.Event()
                # While no other task reads the connection, this one does (`net/reading.py`).
                await self._conn.read_until(self, self._readable.is_set)
                if not self._readable.is_set():  # (waiting on a set event would still yield)
                    await self._readable.wait()
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
            self._conn.send_eof(self.stream_id)
            if not self._conn.is_remote_open(self.stream_id):
                self._ended()
            await self._conn.write_inline()
        await trio.lowlevel.checkpoint()

    def reset(self, reason: str = "reset by the application", code=ErrorCode.CANCEL) -> None:
        """Abort both directions now; the peer's operations raise StreamResetError(reason)."""
        if self._error is None and not self._closed:
            self._conn.reset_stream(self.stream_id, code, reason)
            self.fail(StreamResetError(self.stream_id, code, reason, by_peer=False))

    async def aclose(self) -> None:
        """Finish the stream: half-close if the peer already finished sending, otherwise
        reset it with CANCEL (the peer learns we stopped reading)."""
        if not self._closed:
            if self._error is None:
                if self._conn.is_remote_open(self.stream_id):
                    why = "closed by the application"
                    self._conn.reset_stream(self.stream_id, ErrorCode.CANCEL, why)
                elif not self._eof_sent:
                    self._eof_sent = True
                    self._conn.send_eof(self.stream_id)
            self._closed = True
            self._conn.forget_stream(self.stream_id)
            self._ended()
        await trio.lowlevel.checkpoint()
