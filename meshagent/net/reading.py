"""SocketReader: reads a connection's socket into its record reader, from whichever task
waits for the bytes.

Normally the connection's reader task does: it wakes when bytes arrive, has the connection
process the records (frames to streams, which wakes the task reading each stream one scheduler
pass later) and waits again. A task that waits on a stream with nothing buffered may instead
take the reading for itself while the reader task is idle (`read_for`): it then waits on the
socket, is woken by the kernel directly, and has what arrives processed (for every stream,
control frames included) until something for its own stream is there. That saves a hand-off
and its scheduler pass on each message, a good part of a small round trip. Then the reading
goes back to the reader task.

Only one task may wait on a socket at a time: taking the reading cancels the reader task's
wait (trio removes the registration at once), and the reader task waits until it is back.

A task that holds the reading waits on the socket, not on its stream's event, so a stream
that fails meanwhile must wake it (`wake_holder`), and it must wake the way the event would
have: rescheduled, not cancelled, so that its `receive_some` raises the stream's error before
anything else. A connection that ends cancels the tasks serving its streams: a cancelled
holder would see Cancelled instead of the reset and could not say its stream broke. So the
holder waits on a duplicate of the socket's descriptor of its own, and a connection that ends,
or a stream reset while its connection lives, wakes it through that one
(`trio.lowlevel.notify_closing`: its waiter wakes with ClosedResourceError at once; the
descriptor stays open until the connection closes). No cancel scope per wait: entering and
leaving one costs more than the rest of a small message's reading.

Reads go through a non-blocking socket without trio's per-call checkpoints, straight into the
record reader's buffer.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from meshagent.wire.sealed_records import RecordReader

# A read this small most likely emptied the socket (a message, not a stream of them), so the
# reader waits for the next one rather than trying a recv that would fail.
_SMALL_READ = 16 * 1024


class _Reader:
    """What both readers share: the record reader they feed and the connection's callbacks."""

    def __init__(
        self,
        records: RecordReader,
        *,
        read_size: int,
        process: Callable[[], bool],
        backlogged: Callable[[], bool],
        flush: Callable[[], Awaitable[None]],
    ) -> None:
        """`process` handles the records buffered so far and returns False once the
        connection is closed; while `backlogged`, reading waits for `flush`."""
        self.records = records
        self.read_size = read_size
        self.bytes_received = 0
        self.turns = 0  # how often a stream's task took the reading
        self._process = process
        self._backlogged = backlogged
        self._flush = flush


class SocketReader(_Reader):
    def __init__(self, sock: socket.socket, records: RecordReader, **how: Any) -> None:
        super().__init__(records, **how)
        self.sock = sock
        self.holder: object | None = None  # the stream whose task reads now; None: the reader
        self._holder_sock = socket.socket(fileno=os.dup(sock.fileno()))  # what holders wait on
        self._holder_sock.setblocking(False)
        self._holder_waiting = False  # a holder waits on `_holder_sock` now
        self._retired = False  # the connection is ending: no more holders
        self._parked: trio.CancelScope | None = None  # the reader task's wait on the socket
        self._away = False  # the reader task waits for the reading to come back
        self._back = trio.Event()

    # ----- the reader task -----

    async def run(self, leftover: bytes = b"") -> None:
        """The reader task's loop. Returns once `process` says the connection is closed;
        raises EOFError at EOF, and what reading or processing raises."""
        records = self.records
        if leftover:
            self.bytes_received += len(leftover)
            records.receive_data(leftover)
        waited = drained = False
        while True:
            if records.buffered and not self._process():
                return
            while self._backlogged():
                await self._flush()  # the peer must read our replies before we read on
            if drained:  # a small read took all there was: skip the doomed recv
                await self._park()
                waited = True
            room = records.writable(self.read_size)
            try:
                n = self.sock.recv_into(room)
            except (BlockingIOError, InterruptedError):
                await self._park()
                waited = True
                continue
            if not n:
                raise EOFError
            records.written(n)
            self.bytes_received += n
            if not waited and len(room) >= self.read_size:
                # The socket had more at once: a busy peer. Let the tasks reading our streams
                # run (and return credit) before reading on. (Not after a read that only
                # finished a record: that would yield twice a record.)
                await trio.lowlevel.cancel_shielded_checkpoint()
            waited = False
            # Less than asked for, and little: the socket is empty. (A read that filled the
            # rest of a record, however small, says nothing.)
            drained = n < len(room) and n < _SMALL_READ
            room.release()

    async def _park(self) -> None:
        """Wait until the socket is readable, or, when a stream's task took the reading
        meanwhile, until it is back. Either way the caller then tries to read."""
        with trio.CancelScope() as scope:
            self._parked = scope
            try:
                await trio.lowlevel.wait_readable(self.sock)
            finally:
                self._parked = None
        # Taken, whether the wait was cancelled or had just ended (then the bytes are the
        # holder's to read).
        self._away = True
        try:
            while self.holder is not None:
                await self._back.wait()
        finally:
            self._away = False

    # ----- a task waiting on a stream -----

    def wake_holder(self, holder: object) -> None:
        """`holder`'s stream failed while its connection lives: stop its wait (as `retire`
        does; its descriptor stays open, and the next holder waits on it anew)."""
        if self.holder is holder and self._holder_waiting:
            trio.lowlevel.notify_closing(self._holder_sock)

    def retire(self) -> None:
        """The connection is ending: wake a holder (ClosedResourceError, not a cancel) and
        let no task take the reading again."""
        if not self._retired:
            self._retired = True
            trio.lowlevel.notify_closing(self._holder_sock)

    def close(self) -> None:
        self.retire()
        self._holder_sock.close()

    async def read_for(self, holder: object, ready: Callable[[], bool]) -> bool | None:
        """Read (and process) from this task until `ready()`, if the reader task is idle:
        returns None when it is not (nothing was done), False once the connection is closed
        or backlogged, True when ready. Raises EOFError at EOF, and what reading or
        processing raises."""
        if self.holder is not None or (self._parked is None and not self._away):
            return None
        if self._retired or self._backlogged():
            return None
        self.holder = holder
        self.turns += 1
        if self._parked is not None:
            self._parked.cancel()  # trio unregisters its wait on the socket here and now
        try:
            return await self._read_until(ready)
        finally:
            self.holder = None
            self._back.set()
            self._back = trio.Event()

    async def _read_until(self, ready: Callable[[], bool]) -> bool:
        records, sock = self.records, self.sock
        while not ready():
            if self._backlogged():
                return False
            self._holder_waiting = True
            try:
                await trio.lowlevel.wait_readable(self._holder_sock)
            except trio.ClosedResourceError:
                return False  # retired (the connection is ending), or its stream failed
            finally:
                self._holder_waiting = False
            full = True
            while full:  # what the socket has now
                room = records.writable(self.read_size)
                try:
                    n = sock.recv_into(room)
                except (BlockingIOError, InterruptedError):
                    break
                full = n == len(room)
                room.release()
                if not n:
                    raise EOFError
                records.written(n)
                self.bytes_received += n
                if records.buffered and not self._process():
                    return False
        return True


class TransportReader(_Reader):
    """The reader for a transport other than a socket (a relay's splice): the reader task
    receives and processes; a stream's task never takes the reading."""

    def __init__(self, transport: trio.abc.ReceiveStream, records: RecordReader, **how: Any):
        super().__init__(records, **how)
        self.transport = transport

    async def run(self, leftover: bytes = b"") -> None:
        """As `SocketReader.run`."""
        data = leftover
        while True:
            if data:
                self.bytes_received += len(data)
                self.records.receive_data(data)
            if self.records.buffered and not self._process():
                return
            while self._backlogged():
                await self._flush()  # the peer must read our replies before we read on
            data = await self.transport.receive_some(self.read_size)
            if not data:
                raise EOFError

    async def read_for(self, holder: object, ready: Callable[[], bool]) -> None:
        return None

    def wake_holder(self, holder: object) -> None:
        pass

    def retire(self) -> None:
        pass

    def close(self) -> None:
        pass
