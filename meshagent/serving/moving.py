"""A split's streams move with their connection.

When the connection a stage stream runs over is replaced (drain-and-close: a punched direct
path replaces a relayed one, or a reconnect an old one), the stream does not wait there for
the drain grace to run out. Its sender opens a stream to the same peer on the connection now
in force, sends `Moved(move)` last on the old stream and `Continue(move)` first on the new
one, and puts everything after on the new one. The receiver reads the old stream up to
`Moved`, then reads on from the stream that began with `Continue` of the same move, from the
same peer: the messages stay in order, and what each side holds (the stages' KV and
samplers, the entry's awaited windows) is untouched. Nothing is sent twice and nothing is
replayed.

`MovingOutbox` is the sender's side, `MovingReader` and `Handover` the receiver's. A stream
whose connection is going away for good (its peer is leaving: no other connection to it)
stays where it is, as before.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import trio

from meshagent.net.outbox import Outbox
from meshagent.serving import stage_messages as sm

log = structlog.get_logger(__name__)

Reopen = Callable[[], Awaitable[trio.abc.SendStream]]

# After a move that could not be made (no other connection to the peer yet), it is tried
# again this much later: the new connection is usually adopted within a few ms.
RETRY_AFTER = 0.25
# How long a move waits for its new stream to open (the old one carries on meanwhile).
OPEN_WAIT = 2.0
# How long a reader that met `Moved` waits for the stream that continues it, and a stream
# that begins with `Continue` for the reader that takes it.
HANDOVER_WAIT = 10.0
# Streams that begin with `Continue` a receiver holds at once, waiting for their reader.
MAX_PARKED = 4
# A leaving agent ends a split's stream once nothing went on it for this long.
IDLE_QUIET = 0.2


def connection_of(stream: Any) -> Any:
    """The overlay connection a stream runs over (None for in-process streams)."""
    return getattr(stream, "connection", None)


def _replaced(conn: Any) -> bool:
    """Whether `conn` takes no new streams (GOAWAY, either way) but is not closed yet."""
    return conn is not None and not conn.accepting_streams and not conn.is_closed


class MovingOutbox:
    """An `Outbox` that follows its peer onto the connection that replaces its stream's.

    It moves when its connection stops taking new streams: at once, by a watch on the
    connection, or at the next `put` (whichever comes first). Until the new stream is open,
    puts go on the old one, which carries them through its drain; from the switch on, on
    the new one. A failure of the stream in force goes to `on_error`; one of a stream it
    has moved from does not (the receiver has what it needs from it, or breaks the chain
    itself)."""

    def __init__(
        self,
        stream: trio.abc.SendStream,
        nursery: trio.Nursery,
        on_error: Callable[[BaseException], None],
        reopen: Reopen | None,
    ) -> None:
        self._nursery = nursery
        self._on_error = on_error
        self._reopen = reopen
        self._outbox = self._box(stream)
        self._moving = False  # a move is opening its new stream
        self._retry_at = 0.0
        self._watch: trio.CancelScope | None = None
        self._closed = False
        self._start_watch()

    @property
    def stream(self) -> trio.abc.SendStream:
        """The stream in force."""
        return self._outbox.stream

    @property
    def failed(self) -> BaseException | None:
        return self._outbox.failed

    def _box(self, stream: trio.abc.SendStream) -> Outbox:
        def lost(error: BaseException) -> None:
            if box is self._outbox and not self._closed:
                self._on_error(error)

        box = Outbox(stream, self._nursery, lost)
        return box

    def _due(self) -> bool:
        """Whether the stream in force should move now."""
        return (
            self._reopen is not None
            and not (self._moving or self._closed)
            and self._outbox.failed is None
            and _replaced(connection_of(self._outbox.stream))
            and trio.current_time() >= self._retry_at
        )

    def put(self, data: bytes) -> None:
        """Send `data` after everything put before it, on whichever stream is in force."""
        if self._due():
            with contextlib.suppress(RuntimeError):  # the nursery is closing: no move now
                self._nursery.start_soon(self._move)
        self._outbox.put(data)

    async def _move(self) -> bool:
        """Open a stream to the same peer on the connection in force and switch to it; False
        (and try again `RETRY_AFTER` later) where none opens there."""
        if not self._due():
            return False
        self._moving = True
        try:
            old = self._outbox
            conn = connection_of(old.stream)
            new: trio.abc.SendStream | None = None
            why = "opening the new stream took too long"
            assert self._reopen is not None
            with trio.move_on_after(OPEN_WAIT):
                try:
                    new = await self._reopen()
                except Exception as e:
                    why = str(e)
            if new is not None and (
                getattr(new, "peer_id", None) != getattr(old.stream, "peer_id", None)
                or connection_of(new) is conn
            ):
                why = "no other connection to the same peer"
                await trio.aclose_forcefully(new)
                new = None
            if new is None or self._closed or old.failed is not None or old is not self._outbox:
                if new is not None:
                    await trio.aclose_forcefully(new)
                log.debug("stage.stream_stays", why=why)
                self._retry_at = trio.current_time() + RETRY_AFTER
                return False
            move = secrets.randbits(63)
            old.put(sm.encode(sm.Moved(move)))
            self._outbox = self._box(new)
            self._outbox.put(sm.encode(sm.Continue(move)))
        finally:
            self._moving = False
        log.info(
            "stage.stream_moved",
            peer=getattr(new, "peer_id", None),
            label=getattr(new, "label", None),
            path=getattr(connection_of(new), "path", None),
        )
        self._nursery.start_soon(self._finish, old)
        self._start_watch()
        return True

    async def _finish(self, old: Outbox) -> None:
        """The stream moved from: everything queued on it (its `Moved` last) sent, then EOF."""
        try:
            await old.flush()
            if old.failed is None:
                await old.stream.send_eof()  # type: ignore[attr-defined]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the receiver took what it needed, or breaks the chain itself

    def _start_watch(self) -> None:
        """Move as soon as the connection in force stops taking new streams (trying again
        while it drains), even while nothing is put."""
        self.stop_watching()
        conn = connection_of(self._outbox.stream)
        event = getattr(conn, "no_new_streams", None)
        if self._reopen is None or event is None or self._closed:
            return
        scope = self._watch = trio.CancelScope()

        async def watch() -> None:
            with scope:
                await event.wait()
                while connection_of(self._outbox.stream) is conn and not conn.is_closed:
                    if self._due() and await self._move():
                        return
                    await trio.sleep(RETRY_AFTER)

        try:
            self._nursery.start_soon(watch)
        except RuntimeError:
            self._watch = None

    def stop_watching(self) -> None:
        """Move only when something is put from now on (the sender has stopped reading
        what it sends on; its nursery may then close)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        """Put no more: later puts are dropped, and no move starts."""
        self._closed = True
        self.stop_watching()
        self._outbox.close()


@dataclass
class Parked:
    """A stream that began with `Continue`, waiting for the reader of the stream it carries
    on: the reader takes it with its decoder and the messages already decoded after the
    `Continue`, and releases it when done."""

    stream: trio.abc.ReceiveStream
    decoder: sm.StageDecoder
    ready: list[sm.Message]
    taken: trio.Event = field(default_factory=trio.Event)
    released: trio.Event = field(default_factory=trio.Event)
    evicted: bool = False

    def release(self) -> None:
        self.released.set()


class Handover:
    """Where a receiver's reader that met `Moved(move)` finds the stream from the same peer
    that began with `Continue(move)`: at most `most` such streams wait at once, each at most
    `wait` seconds (a peer's `Continue` that nothing awaits is reset, and costs no more)."""

    def __init__(self, *, wait: float = HANDOVER_WAIT, most: int = MAX_PARKED) -> None:
        self.wait = wait
        self.most = most
        self._parked: dict[tuple[str | None, int], Parked] = {}
        self._changed = trio.Event()

    async def park(
        self,
        stream: trio.abc.ReceiveStream,
        move: int,
        decoder: sm.StageDecoder,
        ready: list[sm.Message],
    ) -> None:
        """The handler of a stream that began with `Continue(move)`: hold it until a reader
        takes it and is done with it (the handler then closes it), or reset it."""
        key = (getattr(stream, "peer_id", None), move)
        if key in self._parked:
            reset(stream, "a stream already continues this move")
            return
        while len(self._parked) >= self.most:
            oldest = self._parked.pop(next(iter(self._parked)))
            oldest.evicted = True
            oldest.taken.set()
        parked = self._parked[key] = Parked(stream, decoder, ready)
        self._changed.set()
        self._changed = trio.Event()
        try:
            with trio.move_on_after(self.wait):
                await parked.taken.wait()
            if not parked.taken.is_set() or parked.evicted:
                reset(stream, "no stream of this stage moved here")
                return
            await parked.released.wait()
        finally:
            if self._parked.get(key) is parked:
                del self._parked[key]

    async def take(self, peer: str | None, move: int) -> Parked:
        """The stream that continues `peer`'s stream which ended with `Moved(move)`."""
        with trio.move_on_after(self.wait):
            while (parked := self._parked.pop((peer, move), None)) is None:
                await self._changed.wait()
            parked.taken.set()
            return parked
        raise sm.StageProtocolError(
            f"the stream moved to a new connection, but nothing continued it in {self.wait:g} s"
        )


def reset(stream: trio.abc.ReceiveStream, why: str) -> None:
    """Reset a mesh stream with `why` (an in-process stream has no reset: nothing to do)."""
    method = getattr(stream, "reset", None)
    if method is not None:
        method(why)


async def first_messages(stream: trio.abc.ReceiveStream, decoder: sm.StageDecoder) -> list:
    """The first whole messages on a new stream ([] if it ends before one)."""
    while data := await stream.receive_some():
        if msgs := decoder.feed(data):
            return msgs
    return []


class MovingReader:
    """Reads one stage stream's messages across its moves, in order: at `Moved` it goes on
    with the stream that `handover` holds for it. `Continue` anywhere else, or anything
    after `Moved`, is a protocol error."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        decoder: sm.StageDecoder,
        handover: Handover,
        ready: list[sm.Message] | None = None,
        error: sm.StageProtocolError | None = None,
        read: Callable[[], None] | None = None,
    ) -> None:
        self.stream = stream
        self._error = error  # raised first: the stream's first bytes were bad
        # Called once this reader is done with its first stream (it moved on, or ended): the
        # stream's own handler may then close it.
        self._read = read
        self._decoder = decoder
        self._handover = handover
        self._ready = list(ready or ())
        self._taken: Parked | None = None
        self.moves = 0

    async def receive(self) -> list[sm.Message]:
        """The next messages, in order; [] once the stream (as moved) ends. Raises
        `StageProtocolError` and what the stream raises."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        while True:
            if self._ready:
                msgs, self._ready = self._ready, []
            else:
                data = await self.stream.receive_some()
                if not data:
                    return []
                msgs = self._decoder.feed(data)
            for i, msg in enumerate(msgs):
                if isinstance(msg, sm.Continue):
                    raise sm.StageProtocolError("Continue comes only first on a stream")
                if isinstance(msg, sm.Moved):
                    if i + 1 < len(msgs):
                        raise sm.StageProtocolError("a stream went on after it moved")
                    await self._follow(msg.move)
                    msgs = msgs[:i]
                    break
            if msgs:
                return msgs

    async def _follow(self, move: int) -> None:
        old = self.stream
        parked = await self._handover.take(getattr(old, "peer_id", None), move)
        self.close()  # the stream before this one: its handler may close it
        self._taken = parked
        self.stream, self._decoder, self._ready = parked.stream, parked.decoder, parked.ready
        self.moves += 1

    def close(self) -> None:
        """Done reading the stream now read: its handler may close it."""
        if self._read is not None:
            self._read()
            self._read = None
        if self._taken is not None:
            self._taken.release()
            self._taken = None
