"""A carried completion follows its asker's connection (docs/protocol.md 11.1).

When the connection a `gen/1` stream runs over is replaced (drain-and-close: a punched direct
path replaces a relayed one), the completion does not stay there until the drain grace cuts
it, which would make the asker replay it on a new stream (its whole history again). The
asker, which opened the stream, opens another to the same entry on the connection now in
force, beginning with `Rejoin(ticket)`: the ticket it gave in its `Ask`. The entry takes it
only from the same peer, for a completion it is still answering: it sends `Moved` last on the
old stream and everything after on the new one, so nothing is sent twice or lost, and what the
entry holds (the sequence, its KV, its sampler) is untouched. An entry that holds no such
completion answers `Fail`, and the asker reads on where it was.

`Answering` and `Rejoins` are the entry's side, `Rejoiner` the asker's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
import trio

from meshagent.api.gen_messages import Message, Moved, Rejoin, encode
from meshagent.api.gen_stream import frames
from meshagent.errors import MeshError
from meshagent.serving.moving import OPEN_WAIT, RETRY_AFTER, connection_of
from meshagent.wire.framing import LengthPrefixDecoder

log = structlog.get_logger(__name__)


def new_ticket() -> int:
    """A random ticket (from the OS, as the sampler's seeds are not: those a test may fix)."""
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1


class Answering:
    """The entry's stream for one completion: the one in force, which a rejoin replaces."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._lock = trio.Lock()  # a message is sent whole on one stream, in order
        self.moves = 0
        self.done = trio.Event()  # the completion is answered: a rejoined stream may close

    async def asker_gone(self) -> None:
        """Return when the asker closes the stream in force (its client went away); a
        stream it closes after a move is not that."""
        while True:
            stream = self.stream
            try:
                while await stream.receive_some():
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if stream is self.stream:
                return

    async def send(self, msg: Message) -> None:
        async with self._lock:
            await self.stream.send_all(encode(msg))

    async def send_quietly(self, msg: Message) -> None:
        """Send `msg` unless the stream is gone (its peer left: nothing to tell)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.send(msg)

    async def move_to(self, new: trio.abc.Stream) -> None:
        """Everything from now on goes on `new`: `Moved` ends the old stream."""
        async with self._lock:
            old, self.stream = self.stream, new
            self.moves += 1
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await old.send_all(encode(Moved()))
                await old.send_eof()  # type: ignore[attr-defined]
        log.info("gen.stream_moved", peer=getattr(new, "peer_id", None), moves=self.moves)


class Rejoins:
    """The completions this entry answers that their askers may rejoin: by asker and ticket.
    While `run` runs, each is answered in its own task (`answer`), not in the handler of the
    stream it came on: that one ends with its connection, which a rejoin has replaced."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], Answering] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def answer(self, work: Callable[[], Awaitable[None]], answering: Answering) -> None:
        """Run `work` (which sets `answering.done` last) where a connection's end does not
        cancel it, and return once it is done; in this task where `run` does not run. A bug
        in it ends its stream, as it would have ended the stream's handler, never the
        agent."""
        if self._nursery is None:
            await work()
            return

        async def guarded() -> None:
            try:
                await work()
            except Exception as e:
                log.exception("gen.answer_failed")
                reset = getattr(answering.stream, "reset", None)
                if reset is not None:
                    reset(f"the entry failed: {e!r}")
            finally:
                answering.done.set()

        self._nursery.start_soon(guarded)
        await answering.done.wait()

    @contextlib.contextmanager
    def holding(self, peer_id: str, ticket: int | None, answering: Answering) -> Iterator[None]:
        key = (peer_id, ticket)
        if ticket is None or key in self._held:  # (a repeated ticket: the first keeps it)
            yield
            return
        self._held[key] = answering
        try:
            yield
        finally:
            del self._held[key]

    def find(self, peer_id: str, ticket: int) -> Answering | None:
        return self._held.get((peer_id, ticket))


Reopen = Callable[[], Awaitable[trio.abc.Stream]]


class Rejoiner:
    """The asker's side: while it reads a completion, `watch` opens a stream to the entry on
    the connection that replaces the one read from, and rejoins there; `moved` switches the
    reader over once the entry's `Moved` comes."""

    def __init__(self, ticket: int, reopen: Reopen) -> None:
        self.ticket = ticket
        self._reopen = reopen
        self.stream: trio.abc.Stream | None = None  # the stream read now
        self._next: trio.abc.Stream | None = None  # the stream rejoined, not read yet
        self._changed = trio.Event()  # set (and replaced) when the stream read changes

    async def reading(self, stream: trio.abc.Stream | None) -> None:
        """The stream read from now: a new entry asked, or None once closed. A stream
        rejoined and never read (its entry answered elsewhere) is closed."""
        stale, self._next = self._next, None
        self._read(stream)
        if stale is not None:
            await trio.aclose_forcefully(stale)

    def _read(self, stream: trio.abc.Stream | None) -> None:
        self.stream = stream
        self._changed.set()
        self._changed = trio.Event()

    def moved(self) -> tuple[trio.abc.Stream, LengthPrefixDecoder] | None:
        """The entry's `Moved` came: the stream to read on (None if this asker rejoined
        nowhere, which the caller treats as a broken stream)."""
        new, self._next = self._next, None
        if new is None:
            return None
        self._read(new)
        return new, frames()

    async def watch(self) -> None:
        """Rejoin whenever the connection of the stream read stops taking new streams and
        another connection to the entry is up. Runs until cancelled."""
        while True:
            changed, stream = self._changed, self.stream
            conn = connection_of(stream)
            event = getattr(conn, "no_new_streams", None)
            if event is None or self._next is not None or conn.is_closed:
                await changed.wait()
            elif not event.is_set():
                async with trio.open_nursery() as n:  # whichever comes first
                    n.start_soon(_then_cancel, event.wait, n.cancel_scope)
                    n.start_soon(_then_cancel, changed.wait, n.cancel_scope)
            elif not await self._rejoin(stream, conn):
                await trio.sleep(RETRY_AFTER)

    async def _rejoin(self, stream: trio.abc.Stream | None, conn: Any) -> bool:
        new: trio.abc.Stream | None = None
        with trio.move_on_after(OPEN_WAIT):
            with contextlib.suppress(MeshError, OSError, trio.BrokenResourceError):
                new = await self._reopen()
        if new is None:
            return False
        if connection_of(new) is conn or stream is not self.stream:
            await trio.aclose_forcefully(new)  # no other connection to the entry yet
            return False
        try:
            await new.send_all(encode(Rejoin(self.ticket)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(new)
            return False
        self._next = new
        log.info("gen.rejoined", peer=getattr(new, "peer_id", None))
        return True


async def _then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()
