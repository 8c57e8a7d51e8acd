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

Reads go through a non-blocking socket without trio's per-call checkpoints, straight into the
record reader's buffer.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio

from meshagent.wire.records import RecordReader

# A read this small most likely emptied the socket (a message, not a stream of them), so the
# reader waits for the next one rather than trying a recv that would fail.
_SMALL_READ = 16 * 1024


class SocketReader:
    def __init__(
        self,
        sock: socket.socket,
        records: RecordReader,
        *,
        read_size: int,
        process: Callable[[], bool],
        backlogged: Callable[[], bool],
        flush: Callable[[], Awaitable[None]],
    ) -> None:
        """`process` handles the records buffered so far and returns False once the
        connection is closed; while `backlogged`, reading waits for `flush`."""
        self.sock = sock
        self.records = records
        self.read_size = read_size
        self.bytes_received = 0
        self.turns = 0  # how often a stream's task took the reading
        self._process = process
        self._backlogged = backlogged
        self._flush = flush
        self.holder: object | None = None  # the stream whose task reads now; None: the reader
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

    async def read_for(self, holder: object, ready: Callable[[], bool]) -> bool | None:
        """Read (and process) from this task until `ready()`, if the reader task is idle:
        returns None when it is not (nothing was done), False once the connection is closed
        or backlogged, True when ready. Raises EOFError at EOF, and what reading or
        processing raises."""
        if self.holder is not None or (self._parked is None and not self._away):
            return None
        if self._backlogged():
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
            await trio.lowlevel.wait_readable(sock)
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
