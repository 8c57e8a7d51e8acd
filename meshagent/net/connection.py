"""Connection: a secured, multiplexed link to one peer, after a completed handshake.

Three tasks, all owned by `run`: the reader feeds received bytes through the record reader
and the multiplexer and dispatches events; the writer seals queued frames and writes them in
batches; the pinger measures RTT and detects a dead peer. Inbound streams are served by the
`on_stream` callback, called in order of arrival, in tasks owned by the connection too.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import structlog
import trio

from meshagent.net.config import OverlayConfig
from meshagent.net.errors import ConnectionUnavailable, StreamResetError, reset_reasons
from meshagent.net.reading import SocketReader, TransportReader
from meshagent.net.record_writer import RecordWriter
from meshagent.net.stream import MeshStream
from meshagent.wire.errors import ErrorCode, LocalUsageError, ProtocolError
from meshagent.wire.events import (
    ConnectionTerminated,
    CreditGranted,
    DataReceived,
    Event,
    GoAway,
    StreamClosed,
    StreamOpened,
    StreamReset,
)
from meshagent.wire.frames import FrameDecoder
from meshagent.wire.handshake import HandshakeResult, LocalPeer
from meshagent.wire.mux import Multiplexer
from meshagent.wire.rtt import RttSnapshot
from meshagent.wire.sealed_records import RecordReader, RecordSealer

log = structlog.get_logger(__name__)

# Called with each inbound stream as it arrives, in the order streams arrive; what it returns
# is awaited in the stream's own task. An `async def handle(stream)` is one; a plain function
# that decides at arrival (a budget, say) and returns the work is another.
StreamAcceptor = Callable[[MeshStream], Awaitable[None]]

DIRECT = "direct"
RELAYED = "relayed"
_TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class Connection:
    """One authenticated connection. Create it from a handshake result, then `run` it."""

    def __init__(
        self,
        transport: trio.abc.Stream,
        result: HandshakeResult,
        local: LocalPeer,
        *,
        config: OverlayConfig | None = None,
        on_stream: StreamAcceptor | None = None,
        on_silent: Callable[[Connection], None] | None = None,
        remote: str = "?",
        path: str = DIRECT,
        leftover: bytes = b"",
    ) -> None:
        self.config = config or OverlayConfig()
        self.peer_id = result.peer_id
        self.session_id = result.session_id
        self.initiator = result.initiator
        self.remote_incarnation = result.remote_incarnation
        self.version = result.version
        self.cipher = result.cipher
        self.local_peer_id = local.peer_id
        self.remote = remote
        self.path = path
        self.mux = Multiplexer(
            initiator=result.initiator,
            local_settings=local.settings,
            remote_settings=result.remote_settings,
            clock=trio.current_time,
        )
        self._transport = transport
        self._on_stream = on_stream
        self._on_silent = on_silent
        # On a socket, reads and writes go through a non-blocking duplicate of its descriptor
        # without trio's per-call checkpoints; we wait on it only when it would block.
        self._sock: socket.socket | None = None
        if isinstance(transport, trio.SocketStream):
            self._sock = socket.socket(fileno=os.dup(transport.socket.fileno()))
            self._sock.setblocking(False)
        self._writer_state = RecordWriter(
            transport,
            RecordSealer(result.send_key, result.cipher),
            self.config.write_batch,
            self._sock,
        )
        self._decoder = FrameDecoder(RecordReader(result.recv_key, result.cipher))
        self._leftover = leftover
        # Reads and processes what arrives: the reader task, or a task waiting on a stream.
        how = {"read_size": self.config.read_size, "process": self._process_records}
        how |= {"backlogged": self._backlogged, "flush": self._flush}
        records = self._decoder.records
        self._input: SocketReader | TransportReader = (
            TransportReader(transport, records, **how)
            if self._sock is None
            else SocketReader(self._sock, records, **how)
        )
        self._streams: dict[int, MeshStream] = {}
        self._nursery: trio.Nursery | None = None
        self._writer_wakeup = trio.Event()
        self._writing = False  # one writer at a time: the writer task or an inline send
        # Set (and replaced) after each write completes / on any stream progress; replaced only
        # while someone waits, so the hot path creates no events.
        self._write_done = trio.Event()
        self._write_waiters = 0
        self._progress = trio.Event()
        self._progress_waiters = 0
        self._done = trio.Event()
        self._closing = False
        self._dead = False
        self._broken = False  # the peer broke the protocol
        # Set once no new streams may be opened here, by either side's GOAWAY (the
        # connection was replaced, or its peer is leaving): a stream that can follow its
        # peer to another connection moves then (`serving/moving.py`).
        self.no_new_streams = trio.Event()
        self._draining = False
        # Ended by the transport (a reset, EOF without BYE): neither side chose to close it.
        self.lost = False
        self.close_code: ErrorCode | None = None
        self.close_reason: str | None = None
        self.established_at = trio.current_time()
        self.closed_at: float | None = None
        self._log = log.bind(peer=self.peer_id, session=self.session_id)

    # ----- public state -----

    def stream_labels(self) -> list[str]:
        """The labels of the streams open on it now."""
        return [stream.label for stream in self._streams.values()]

    @property
    def initiator_peer_id(self) -> str:
        return self.local_peer_id if self.initiator else self.peer_id

    @property
    def bytes_sent(self) -> int:
        return self._writer_state.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._input.bytes_received

    @property
    def rtt(self) -> RttSnapshot:
        return self.mux.rtt

    def silent_for(self) -> float:
        """Seconds since the peer last answered a PING (or since the connection began)."""
        return trio.current_time() - self.mux.last_pong_at

    def silence_bound(self) -> float | None:
        """How long without an answer makes this connection silent: `silent_after`, or 8
        smoothed round trips on a slow path."""
        after = self.config.silent_after
        if after is None:
            return None
        return max(after, 8 * (self.rtt.smoothed or 0.0))

    def abort(self, reason: str) -> None:
        """End now, without a BYE (the peer is not answering, so none would arrive)."""
        self._abort(ErrorCode.UNRESPONSIVE, reason)

    @property
    def draining(self) -> bool:
        """We sent GOAWAY (or are about to): the peer may open no new streams here."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:
            self.no_new_streams.set()

    @property
    def is_closed(self) -> bool:
        return self._closing or self._dead

    @property
    def accepting_streams(self) -> bool:
        """Whether new streams may be opened here (not closing, no GOAWAY either way)."""
        return not (self.is_closed or self.draining or self.mux.remote_goaway is not None)

    async def wait_closed(self) -> None:
        await self._done.wait()

    # ----- lifecycle -----

    async def run(self, *, task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED):
        """Serve the connection until it closes, for whatever reason; never raises for
        peer misbehaviour or transport failure (those close it and are logged)."""
        self._log.info(
            "conn.open",
            remote=self.remote,
            path=self.path,
            initiator=self.initiator,
            cipher=self.cipher,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer, name=f"conn-writer-{self.session_id}")
                nursery.start_soon(self._reader, name=f"conn-reader-{self.session_id}")
                nursery.start_soon(self._pinger, name=f"conn-pinger-{self.session_id}")
                task_status.started(self)
        finally:
            await self._finalize()

    async def open_stream(
        self, label: str = "", *, window_bytes: int | None = None, window_frames: int | None = None
    ) -> MeshStream:
        """Open a stream to the peer. `window_*` bound what the peer may have in flight to us
        (and so our memory for this stream); defaults come from our StreamSettings."""
        if self.is_closed:
            raise ConnectionUnavailable(
                f"connection {self.session_id} to {self.peer_id} is closed ({self.close_reason})"
            )
        if self.draining:
            raise ConnectionUnavailable(
                f"connection {self.session_id} to {self.peer_id} is draining"
            )
        try:
            sid = self.mux.open_stream(
                label, window_bytes=window_bytes, window_frames=window_frames
            )
        except LocalUsageError as e:
            raise ConnectionUnavailable(f"cannot open a stream to {self.peer_id}: {e}") from e
        stream = MeshStream(self, sid, label)
        self._streams[sid] = stream
        self._kick()
        await trio.lowlevel.checkpoint()
        return stream

    async def aclose(self, code: ErrorCode = ErrorCode.NO_ERROR, reason: str = "closed") -> None:
        """Close now: unfinished streams are reset with `reason`, BYE is sent, and the
        transport closed. Returns once the connection's tasks have ended."""
        await self._close(code, reason)
        if self._nursery is not None:
            await self._done.wait()
        else:
            await self._finalize()

    async def drain_and_close(
        self,
        *,
        grace: float | None = None,
        code: ErrorCode = ErrorCode.REPLACED,
        reason: str = "replaced",
    ) -> None:
        """Stop taking new streams (GOAWAY), let open streams finish for up to `grace`
        seconds, reset any still open with an error naming `reason`, then close."""
        grace = self.config.drain_grace if grace is None else grace
        if self.is_closed:
            await self._done.wait()
            return
        self.draining = True
        self.mux.go_away(code, reason)
        self._kick()
        self._log.info(
            "conn.draining", reason=reason, open_streams=self.mux.open_streams, grace=grace
        )
        with trio.move_on_after(grace):
            while self.mux.open_streams and not self.is_closed:
                self._progress_waiters += 1
                try:
                    await self._progress.wait()
                finally:
                    self._progress_waiters -= 1
        stuck = [] if self.is_closed else self.mux.open_stream_ids()
        if stuck:
            why = f"connection {reason}: stream still open when the {grace:g} s drain grace expired"
            self._log.warning("conn.drain_expired", reason=reason, streams=stuck, grace=grace)
            for sid in stuck:
                self.reset_stream(sid, code, why)
        await self.aclose(code, reason)

    # ----- used by MeshStream (its `StreamCarrier`) -----

    def send_data(self, stream_id: int, view: memoryview) -> int:
        try:
            return self.mux.send_data(stream_id, view)
        except LocalUsageError as e:
            code = self.close_code or ErrorCode.INTERNAL_ERROR
            raise StreamResetError(stream_id, code, str(e), by_peer=False) from e

    def has_send_credit(self, stream_id: int) -> bool:
        return self.mux.send_credit(stream_id)[0] != 0

    def is_remote_open(self, stream_id: int) -> bool:
        return self.mux.is_remote_open(stream_id)

    async def write_inline(self) -> None:
        """Write queued frames from the calling (application) task when no write is in
        progress, saving a task switch per message; otherwise leave them to the writer."""
        if self._writing or self.is_closed:
            self._kick()
            return
        try:
            await self._write_pending()
        except _TRANSPORT_ERRORS as e:
            self._log.info("conn.lost", during="write", error=str(e))
            self._lose(str(e))

    def write_now(self) -> None:
        """`write_inline` for code that cannot wait: what the socket takes at once goes now,
        the rest to the writer task."""
        if self._writing or self.is_closed:
            self._kick()
            return
        try:
            if not self._writer_state.write_nowait(self.mux):
                self._kick()
        except _TRANSPORT_ERRORS as e:
            self._log.info("conn.lost", during="write", error=str(e))
            self._lose(str(e))

    def read_data(self, stream_id: int, max_bytes: int) -> bytes | bytearray | None:
        data = self.mux.read(stream_id, max_bytes)
        if self.mux.has_output:
            self._kick()
        if data is not None and not data:
            self._notify()
        return data

    def send_eof(self, stream_id: int) -> None:
        try:
            self.mux.send_eof(stream_id)
        except LocalUsageError as e:
            code = self.close_code or ErrorCode.INTERNAL_ERROR
            raise StreamResetError(stream_id, code, str(e), by_peer=False) from e
        self._kick()
        self._notify()

    def reset_stream(self, stream_id: int, code: ErrorCode, reason: str) -> None:
        self.mux.reset(stream_id, code, reason)
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.fail(StreamResetError(stream_id, code, reason, by_peer=False))
            self._wake(stream)
        self._kick()
        self._notify()

    def forget_stream(self, stream_id: int) -> None:
        self.mux.forget(stream_id)
        stream = self._streams.pop(stream_id, None)
        if stream is not None:  # closed here: a task still reading it raises at once
            self._wake(stream)
        self._notify()

    def _wake(self, stream: MeshStream) -> None:
        stream.wake_reader()
        self._input.wake_holder(stream)  # it may wait on the socket, not on its event

    # ----- internals -----

    def _kick(self) -> None:
        self._writer_wakeup.set()

    def _notify(self) -> None:
        if self._progress_waiters:
            self._progress.set()
            self._progress = trio.Event()

    async def _flush(self) -> None:
        """Wait until everything queued so far has been written to the transport."""
        while not self._dead and (
            self.mux.has_output or self._writing or self._writer_state.has_pending
        ):
            self._kick()
            self._write_waiters += 1
            try:
                await self._write_done.wait()
            finally:
                self._write_waiters -= 1

    async def _write_pending(self) -> None:
        self._writing = True
        try:
            await self._writer_state.write(self.mux)
        finally:
            self._writing = False
            if self._writer_state.has_pending or self.mux.has_output:
                self._kick()  # a cancelled inline write leaves the rest to the writer task
            if self._write_waiters:
                self._write_done.set()
                self._write_done = trio.Event()

    async def _close(self, code: ErrorCode, reason: str) -> None:
        """Graceful end from inside or outside the connection's tasks: BYE, flush, cancel."""
        if self._closing or self._dead:
            return
        self._closing = True
        self.close_code, self.close_reason = code, reason
        self._fail_streams(self.mux.close(code, reason))
        self._kick()
        with trio.move_on_after(self.config.close_flush_timeout):
            await self._flush()
        self._cancel()

    def _lose(self, why: str) -> None:
        """The transport failed or ended without BYE: the peer did not choose to close."""
        self.lost = True
        self._abort(ErrorCode.INTERNAL_ERROR, f"connection lost: {why}")

    def _abort(self, code: ErrorCode, reason: str) -> None:
        """Immediate end (transport gone, or the peer said BYE): no flush possible/needed."""
        if self.close_reason is None:
            self.close_code, self.close_reason = code, reason
        self._closing = True
        self._fail_streams(self.mux.close(code, reason))
        self._cancel()

    def _cancel(self) -> None:
        self._write_done.set()
        self._progress.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _fail_streams(self, resets: list[StreamReset]) -> None:
        self._input.retire()  # before the streams' tasks are cancelled
        for ev in resets:
            stream = self._streams.pop(ev.stream_id, None)
            if stream is not None:
                stream.fail(StreamResetError(ev.stream_id, ev.code, ev.reason, by_peer=False))

    async def _finalize(self) -> None:
        if self._dead:
            return
        self._dead = True
        if self.close_reason is None:
            self.close_code, self.close_reason = ErrorCode.SHUTDOWN, "cancelled"
        self._fail_streams(self.mux.close(self.close_code or ErrorCode.SHUTDOWN, self.close_reason))
        self._write_done.set()
        self._progress.set()
        self.closed_at = trio.current_time()
        self._input.close()
        if self._sock is not None:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self._transport)
        self._done.set()
        self._log.info(
            "conn.closed",
            code=self.close_code.name if self.close_code is not None else None,
            reason=self.close_reason,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            seconds=round(self.closed_at - self.established_at, 3),
        )

    async def _writer(self) -> None:
        mux = self.mux
        try:
            while True:
                if (mux.has_output or self._writer_state.has_pending) and not self._writing:
                    await self._write_pending()
                    continue
                await self._writer_wakeup.wait()
                self._writer_wakeup = trio.Event()
        except _TRANSPORT_ERRORS as e:
            self._log.info("conn.lost", during="write", error=str(e))
            self._lose(str(e))

    async def _reader(self) -> None:
        try:
            await self._input.run(self._leftover)
        except EOFError:
            self._log.info("conn.lost", during="read", error="EOF without BYE")
            self._lose("EOF without BYE")
        except ProtocolError as e:
            if self._protocol_error(e):
                await self._close(e.code, f"protocol error: {e}")
        except _TRANSPORT_ERRORS as e:
            self._log.info("conn.lost", during="read", error=str(e))
            self._lose(str(e))

    def _protocol_error(self, e: ProtocolError) -> bool:
        """Log the peer's protocol error; False if one was seen already (by another task)."""
        if self._broken:
            return False
        self._broken = True
        self._log.warning("conn.protocol_error", code=e.code.name, reason=str(e))
        return True

    async def read_until(self, stream: MeshStream, ready: Callable[[], bool]) -> None:
        """While no other task reads the socket, read it from `stream`'s task until `ready()`
        (`net/reading.py`)."""
        if not self.is_closed:
            try:
                await self._input.read_for(stream, ready)
            except EOFError:
                self._log.info("conn.lost", during="read", error="EOF without BYE")
                self._lose("EOF without BYE")
            except ProtocolError as e:
                if self._protocol_error(e) and self._nursery is not None:
                    self._nursery.start_soon(self._close, e.code, f"protocol error: {e}")
            except _TRANSPORT_ERRORS as e:
                self._log.info("conn.lost", during="read", error=str(e))
                self._lose(str(e))

    def _process_records(self) -> bool:  # (for SocketReader: False once closed)
        self._process_frames()
        return not self.is_closed

    def _backlogged(self) -> bool:
        return self.mux.control_backlog > self.config.max_control_backlog and not self._dead

    def _process_frames(self) -> None:
        decoder, mux, dispatch = self._decoder, self.mux, self._dispatch
        while (frame := decoder.next_frame()) is not None:
            for event in mux.handle_frame(frame):
                dispatch(event)
            if self.is_closed:
                break
        if mux.has_output:
            self._kick()
        self._notify()

    def _dispatch(self, ev: Event) -> None:
        kind = type(ev)
        if kind is DataReceived or kind is StreamClosed:
            stream = self._streams.get(ev.stream_id)
            if stream is not None:
                stream.wake_reader()
        elif kind is CreditGranted:
            if ev.stream_id == 0:  # connection credit: any stream may be waiting for it
                for stream in list(self._streams.values()):
                    stream.wake_writer()
            else:
                stream = self._streams.get(ev.stream_id)
                if stream is not None:
                    stream.wake_writer()
        elif kind is StreamOpened:
            self._accept(ev)
        elif kind is StreamReset:
            stream = self._streams.pop(ev.stream_id, None)
            if stream is None and not ev.by_peer and ev.code is ErrorCode.REFUSED_STREAM:
                self._log.warning("stream.refused", stream=ev.stream_id, reason=ev.reason)
            else:
                self._log.debug(
                    "stream.reset", stream=ev.stream_id, code=ev.code.name, by_peer=ev.by_peer
                )
            if stream is not None:
                stream.fail(StreamResetError(ev.stream_id, ev.code, ev.reason, by_peer=ev.by_peer))
        elif kind is GoAway:
            self._log.info("conn.goaway_received", code=ev.code.name, reason=ev.reason)
            self.no_new_streams.set()
        elif kind is ConnectionTerminated:
            self._log.info("conn.bye_received", code=ev.code.name, reason=ev.reason)
            self._abort(ev.code, ev.reason)

    def _accept(self, ev: StreamOpened) -> None:
        if self._on_stream is None or self._nursery is None:
            self.mux.reset(ev.stream_id, ErrorCode.REFUSED_STREAM, "this peer accepts no streams")
            return
        stream = MeshStream(self, ev.stream_id, ev.label)
        self._streams[ev.stream_id] = stream
        # Called here, not in the task: tasks started together run in no set order, and
        # what the acceptor decides at arrival (a budget's count) must follow the peer's.
        work = self._on_stream(stream)
        self._nursery.start_soon(self._serve_stream, stream, work, name=f"stream-{ev.stream_id}")

    async def _serve_stream(self, stream: MeshStream, work: Awaitable[None]) -> None:
        try:
            await work
        except Exception as e:
            resets = reset_reasons(e)
            if resets is not None:  # a peer went or gave up: routine, not a bug
                self._log.info("stream.handler_reset", stream=stream.stream_id, reason=resets)
            else:
                self._log.exception("stream.handler_failed", stream=stream.stream_id)
                why = f"stream handler failed: {type(e).__name__}: {e}"
                stream.reset(why, ErrorCode.INTERNAL_ERROR)
        finally:
            await stream.aclose()

    async def _pinger(self) -> None:
        interval, timeout = self.config.ping_interval, self.config.dead_peer_timeout
        reported = False
        while True:
            self.mux.ping()
            self._kick()
            await trio.sleep(interval)
            silent = self.silent_for()
            if timeout is not None and silent > timeout:
                self._log.warning("conn.unresponsive", silent=round(silent, 1))
                await self._close(ErrorCode.UNRESPONSIVE, f"no reply to PING for {silent:.0f} s")
                return
            bound = self.silence_bound()
            if bound is None or silent <= bound:
                reported = False
            elif not reported and self._on_silent is not None:
                reported = True  # once per silence: the listener decides what it means
                self._log.info("conn.silent", silent=round(silent, 2))
                self._on_silent(self)

    def __repr__(self) -> str:
        return (
            f"Connection(peer={self.peer_id}, session={self.session_id}, path={self.path}, "
            f"initiator={self.initiator}, closed={self.close_reason!r})"
        )
