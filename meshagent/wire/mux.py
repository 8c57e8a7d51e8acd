"""The stream multiplexer, sans-IO: stream states, credit windows, GOAWAY, BYE, PING/PONG.

Frames come in through `handle_frame` (returning events); the application's actions
(`open_stream`, `send_data`, `read`, `send_eof`, `reset`, `go_away`, `close`, `ping`) queue
frames that the I/O layer collects with `frames_to_send`. Nothing here blocks: a sender with
no credit gets 0 from `send_data` and waits for a CreditGranted event, for as long as it takes.

Credit is per stream and for the connection as a whole: DATA spends both, and the receiver
returns the connection's (CREDIT on stream 0) as the application reads or drops data, so
what one connection can make its receiver buffer is bounded by `connection_window_bytes`
however many streams the peer opens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from meshagent.wire.control import MAX_LABEL_LEN
from meshagent.wire.errors import ErrorCode, LocalUsageError, ProtocolError
from meshagent.wire.events import (
    ConnectionTerminated,
    CreditGranted,
    DataReceived,
    Event,
    GoAway,
    PingAcked,
    StreamClosed,
    StreamOpened,
    StreamReset,
)
from meshagent.wire.frames import (
    ByeFrame,
    CloseFrame,
    CreditFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    OpenFrame,
    PingFrame,
    PongFrame,
    ResetFrame,
    data_header,
    encode_frame,
    new_ping,
)
from meshagent.wire.rtt import RttEstimator, RttSnapshot
from meshagent.wire.settings import StreamSettings

MAX_CREDIT = (1 << 32) - 1
Payload = bytes | memoryview
MAX_OUTSTANDING_PINGS = 8


class _Stream:
    """One stream's state. `local_open`: we may still send DATA; `remote_open`: the peer may."""

    __slots__ = (
        "buffer",
        "buffered",
        "grant_bytes",
        "grant_frames",
        "id",
        "label",
        "local_open",
        "peer_credit_bytes",
        "peer_credit_frames",
        "remote_open",
        "send_bytes",
        "send_frames",
        "window_bytes",
        "window_frames",
    )

    def __init__(
        self,
        stream_id: int,
        label: str,
        *,
        send_bytes: int,
        send_frames: int,
        window_bytes: int,
        window_frames: int,
    ) -> None:
        self.id = stream_id
        self.label = label
        self.local_open = True
        self.remote_open = True
        self.send_bytes = send_bytes
        self.send_frames = send_frames
        self.window_bytes = window_bytes
        self.window_frames = window_frames
        # What the peer may still send us; buffered + peer credit + grants pending <= window.
        self.peer_credit_bytes = window_bytes
        self.peer_credit_frames = window_frames
        self.buffer: deque[bytes | bytearray | memoryview] = deque()
        self.buffered = 0
        self.grant_bytes = 0
        self.grant_frames = 0

    @property
    def finished(self) -> bool:
        return not self.local_open and not self.remote_open


class Multiplexer:
    """Many streams over one secured connection. Initiator streams are odd, responder even."""

    def __init__(
        self,
        *,
        initiator: bool,
        local_settings: StreamSettings,
        remote_settings: StreamSettings,
        clock: Callable[[], float],
    ) -> None:
        self.initiator = initiator
        self.local_settings = local_settings
        self.remote_settings = remote_settings
        self._clock = clock
        self._streams: dict[int, _Stream] = {}
        self._next_local_id = 1 if initiator else 2
        self._highest_remote_id = 0
        self._control: list[bytes] = []
        # DATA frames queue as (header, payload) pairs, so the payload is copied once, by the
        # record sealer, rather than again into a frame; CLOSE and BYE queue as bytes.
        self._data: deque[bytes | tuple[bytes, bytes | memoryview]] = deque()
        self._control_bytes = 0
        # The connection window: bytes we may still send on all streams together; bytes the
        # peer may still send us; bytes read or dropped here and not yet credited back.
        self._conn_send = remote_settings.connection_window_bytes
        self._conn_peer_credit = local_settings.connection_window_bytes
        self._conn_grant = 0
        self._pings: dict[bytes, float] = {}
        self._rtt = RttEstimator()
        self.last_pong_at = clock()  # start of the connection counts as a sign of life
        self.local_goaway = False  # we sent GOAWAY: the peer may open no more streams
        self.remote_goaway: GoAway | None = None  # the peer's GOAWAY: we may open no more
        self.closed: ConnectionTerminated | None = None  # BYE sent or received

    # ----- queries -----

    @property
    def rtt(self) -> RttSnapshot:
        return self._rtt.snapshot()

    @property
    def open_streams(self) -> int:
        """Streams not yet closed in both directions (drain waits for this to reach 0)."""
        return sum(1 for s in self._streams.values() if not s.finished)

    def open_stream_ids(self) -> list[int]:
        return [s.id for s in self._streams.values() if not s.finished]

    def buffered(self, stream_id: int) -> int:
        st = self._streams.get(stream_id)
        return 0 if st is None else st.buffered

    def is_remote_open(self, stream_id: int) -> bool:
        """Whether the peer may still send on the stream (no CLOSE or RESET from it yet)."""
        st = self._streams.get(stream_id)
        return st is not None and st.remote_open

    def send_credit(self, stream_id: int) -> tuple[int, int]:
        """(bytes, frames) we may still send on the stream (the connection's window too)."""
        st = self._streams.get(stream_id)
        return (0, 0) if st is None else (min(st.send_bytes, self._conn_send), st.send_frames)

    @property
    def connection_credit(self) -> tuple[int, int]:
        """(bytes we may still send on all streams, bytes the peer may still send us)."""
        return self._conn_send, self._conn_peer_credit

    @property
    def control_backlog(self) -> int:
        """Bytes of queued control frames; the reader pauses while this is large."""
        return self._control_bytes

    @property
    def has_output(self) -> bool:
        return bool(self._control or self._data)

    def frames_to_send(self, max_bytes: int = 1 << 20) -> list[bytes]:
        """Queued frames, control first (credit, pong, reset must not wait behind bulk data),
        then DATA/CLOSE/BYE in order, up to about `max_bytes`."""
        return [f if type(f) is bytes else f[0] + f[1] for f in self.frames_to_seal(max_bytes)]

    def frames_to_seal(self, max_bytes: int = 1 << 20) -> list[bytes | tuple[bytes, Payload]]:
        """`frames_to_send` without joining DATA frames: each is a frame as bytes, or a
        DATA frame as a (header, payload) pair for the sealer to lay out in one copy."""
        out: list[bytes | tuple[bytes, Payload]] = self._control  # type: ignore[assignment]
        self._control = []
        self._control_bytes = 0
        size = 0
        data = self._data
        while data and size < max_bytes:
            frame = data.popleft()
            size += len(frame) if type(frame) is bytes else len(frame[1])
            out.append(frame)
        return out

    # ----- local actions -----

    def open_stream(
        self, label: str = "", *, window_bytes: int | None = None, window_frames: int | None = None
    ) -> int:
        """Open a stream; returns its id. Its receive window defaults to our settings."""
        self._check_can_open()
        if len(label) > MAX_LABEL_LEN:
            raise LocalUsageError(f"stream label is longer than {MAX_LABEL_LEN} characters")
        if self.open_streams_by(local=True) >= self.remote_settings.max_streams:
            raise LocalUsageError(
                f"the peer allows at most {self.remote_settings.max_streams} open streams"
            )
        wb = self.local_settings.window_bytes if window_bytes is None else window_bytes
        wf = self.local_settings.window_frames if window_frames is None else window_frames
        if not (1 <= wb <= MAX_CREDIT and 1 <= wf <= MAX_CREDIT):
            raise LocalUsageError("stream windows must be between 1 and 2**32-1")
        stream_id = self._next_local_id
        self._next_local_id += 2
        self._streams[stream_id] = _Stream(
            stream_id,
            label,
            send_bytes=self.remote_settings.window_bytes,
            send_frames=self.remote_settings.window_frames,
            window_bytes=wb,
            window_frames=wf,
        )
        self._queue_control(encode_frame(OpenFrame(stream_id, wb, wf, label)))
        return stream_id

    def _check_can_open(self) -> None:
        if self.closed is not None:
            raise LocalUsageError(f"connection is closed ({self.closed.reason})")
        if self.remote_goaway is not None:
            raise LocalUsageError(
                f"peer sent GOAWAY ({self.remote_goaway.reason}); open the stream elsewhere"
            )
        if self.local_goaway:
            raise LocalUsageError("connection is going away; open the stream elsewhere")

    def open_streams_by(self, *, local: bool) -> int:
        parity = 1 if self.initiator == local else 0
        return sum(1 for s in self._streams.values() if not s.finished and s.id % 2 == parity)

    def send_data(self, stream_id: int, data: bytes | bytearray | memoryview) -> int:
        """Queue as much of `data` as credit allows; returns the byte count taken (maybe 0).

        Slices of an immutable `bytes` object are queued by reference (the sealer copies them
        once); anything else is copied now, so the caller may reuse its buffer at once.
        """
        st = self._sendable(stream_id)
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        immutable = type(view.obj) is bytes
        total = len(view)
        max_payload = self.remote_settings.max_frame_payload
        header = data_header(stream_id)
        sent = 0
        queue = self._data
        while sent < total and st.send_frames > 0 and st.send_bytes > 0 and self._conn_send > 0:
            n = min(total - sent, st.send_bytes, self._conn_send, max_payload)
            chunk = view[sent : sent + n]
            queue.append((header, chunk if immutable else bytes(chunk)))
            st.send_bytes -= n
            st.send_frames -= 1
            self._conn_send -= n
            sent += n
        return sent

    def send_eof(self, stream_id: int) -> None:
        """Half-close: queue CLOSE after the stream's DATA. Idempotent."""
        st = self._streams.get(stream_id)
        if st is None or not st.local_open:
            return
        if self.closed is not None:
            raise LocalUsageError(f"connection is closed ({self.closed.reason})")
        st.local_open = False
        self._data.append(encode_frame(CloseFrame(stream_id)))
        self._maybe_forget(st)

    def _sendable(self, stream_id: int) -> _Stream:
        if self.closed is not None:
            raise LocalUsageError(f"connection is closed ({self.closed.reason})")
        st = self._streams.get(stream_id)
        if st is None:
            raise LocalUsageError(f"stream {stream_id} is not open")
        if not st.local_open:
            raise LocalUsageError(f"stream {stream_id} was already closed for sending")
        return st

    def read(self, stream_id: int, max_bytes: int) -> bytes | bytearray | None:
        """Up to `max_bytes` of the next buffered DATA payload; b"" at end of stream; None if
        nothing yet. A whole payload is handed over as-is, without copying.

        Consuming data is what returns credit to the peer (batched: a CREDIT frame goes out
        once half a window, in bytes or in frames, has been consumed).
        """
        st = self._streams.get(stream_id)
        if st is None:
            return b""
        buf = st.buffer
        if not buf:
            return None if st.remote_open else b""
        head = buf[0]
        size = len(head)
        if size <= max_bytes:
            buf.popleft()
            out = head if type(head) is not memoryview else bytes(head)
            st.grant_frames += 1
        else:
            view = memoryview(head)
            out = bytes(view[:max_bytes])
            buf[0] = view[max_bytes:]
            size = max_bytes
        st.buffered -= size
        st.grant_bytes += size
        self._maybe_grant(st)
        self._release(size)
        self._maybe_forget(st)
        return out

    def _release(self, n: int) -> None:
        """`n` received bytes left our buffers (read, or dropped with their stream): credit
        them back to the connection, batched like a stream's (half the window)."""
        self._conn_grant += n
        if self._conn_grant * 2 >= self.local_settings.connection_window_bytes:
            self._conn_peer_credit += self._conn_grant
            self._queue_control(encode_frame(CreditFrame(0, self._conn_grant, 0)))
            self._conn_grant = 0

    def _drop(self, st: _Stream) -> None:
        """Forget a stream; the bytes it still buffered go back to the connection window."""
        self._streams.pop(st.id, None)
        if st.buffered:
            self._release(st.buffered)
            st.buffer.clear()
            st.buffered = 0

    def _maybe_grant(self, st: _Stream) -> None:
        if not st.remote_open:
            return
        if st.grant_bytes * 2 >= st.window_bytes or st.grant_frames * 2 >= st.window_frames:
            st.peer_credit_bytes += st.grant_bytes
            st.peer_credit_frames += st.grant_frames
            self._queue_control(encode_frame(CreditFrame(st.id, st.grant_bytes, st.grant_frames)))
            st.grant_bytes = st.grant_frames = 0

    def reset(self, stream_id: int, code: ErrorCode, reason: str) -> None:
        """Abort the stream both ways; buffered data is dropped and the peer is told why."""
        st = self._streams.get(stream_id)
        if st is None:
            return
        self._drop(st)
        if st.finished or self.closed is not None:
            return
        self._queue_control(encode_frame(ResetFrame(stream_id, code, reason)))

    def forget(self, stream_id: int) -> None:
        """The application is done with a finished stream: drop any unread data."""
        st = self._streams.get(stream_id)
        if st is not None and st.finished:
            self._drop(st)

    def go_away(self, code: ErrorCode = ErrorCode.NO_ERROR, reason: str = "") -> None:
        """Take no new streams from the peer; existing streams continue. Idempotent."""
        if self.local_goaway or self.closed is not None:
            return
        self.local_goaway = True
        self._queue_control(encode_frame(GoAwayFrame(self._highest_remote_id, code, reason)))

    def close(self, code: ErrorCode, reason: str) -> list[StreamReset]:
        """End the connection: reset every unfinished stream with `reason`, then queue BYE
        after all queued data. Returns the resets so the I/O layer can fail local waiters."""
        if self.closed is not None:
            return []
        events = []
        for st in list(self._streams.values()):
            if st.finished:
                continue
            del self._streams[st.id]
            self._queue_control(encode_frame(ResetFrame(st.id, code, reason)))
            events.append(StreamReset(st.id, code, reason, by_peer=False))
        self._data.append(encode_frame(ByeFrame(code, reason)))
        self.closed = ConnectionTerminated(code, reason)
        return events

    def ping(self) -> None:
        """Queue a PING; its PONG yields PingAcked with the RTT sample."""
        if self.closed is not None:
            return
        frame = new_ping()
        if len(self._pings) >= MAX_OUTSTANDING_PINGS:
            oldest = min(self._pings, key=self._pings.__getitem__)
            del self._pings[oldest]
        self._pings[frame.opaque] = self._clock()
        self._queue_control(encode_frame(frame))

    # ----- frames from the peer -----

    def handle_frame(self, frame: Frame) -> list[Event]:
        """Apply one frame from the peer. Connection-level violations raise ProtocolError;
        stream-level ones reset that stream (returned as a StreamReset event)."""
        if self.closed is not None:
            return []
        match frame:
            case DataFrame():
                return self._on_data(frame)
            case CreditFrame():
                return self._on_credit(frame)
            case OpenFrame():
                return self._on_open(frame)
            case CloseFrame():
                return self._on_close(frame)
            case ResetFrame():
                return self._on_reset(frame)
            case PingFrame():
                self._queue_control(encode_frame(PongFrame(frame.opaque)))
                return []
            case PongFrame():
                return self._on_pong(frame)
            case GoAwayFrame():
                self.remote_goaway = GoAway(frame.last_stream_id, frame.code, frame.reason)
                return [self.remote_goaway]
            case ByeFrame():
                return self._on_bye(frame)
        raise ProtocolError(f"unexpected frame {type(frame).__name__}")

    def _stream_for(self, stream_id: int, what: str) -> _Stream | None:
        """The live stream, or None for a stream that existed and ended (frames still in
        flight when it ended are ignored). A never-opened id is a connection error."""
        st = self._streams.get(stream_id)
        if st is not None:
            return st
        if self._is_local_id(stream_id):
            if stream_id < self._next_local_id:
                return None
        elif stream_id <= self._highest_remote_id:
            return None
        raise ProtocolError(f"{what} frame for stream {stream_id}, which was never opened")

    def _is_local_id(self, stream_id: int) -> bool:
        return (stream_id % 2 == 1) == self.initiator

    def _stream_error(self, st: _Stream, code: ErrorCode, reason: str) -> list[Event]:
        self._drop(st)
        self._queue_control(encode_frame(ResetFrame(st.id, code, reason)))
        return [StreamReset(st.id, code, reason, by_peer=False)]

    def _on_data(self, frame: DataFrame) -> list[Event]:
        n = len(frame.payload)
        limit = self.local_settings.max_frame_payload
        if n > limit:
            raise ProtocolError(
                f"DATA frame of {n} bytes exceeds the maximum {limit}",
                ErrorCode.FRAME_TOO_LARGE,
            )
        if n > self._conn_peer_credit:
            raise ProtocolError(
                f"DATA of {n} bytes beyond the connection window ({self._conn_peer_credit} "
                "bytes left)",
                ErrorCode.FLOW_CONTROL_ERROR,
            )
        self._conn_peer_credit -= n
        st = self._stream_for(frame.stream_id, "DATA")
        if st is None:
            self._release(n)  # a stream that ended: the bytes are dropped, the credit returns
            return []
        if not st.remote_open:
            self._release(n)
            return self._stream_error(st, ErrorCode.STREAM_CLOSED, "DATA after CLOSE")
        if n > st.peer_credit_bytes or st.peer_credit_frames < 1:
            self._release(n)
            return self._stream_error(
                st,
                ErrorCode.FLOW_CONTROL_ERROR,
                f"DATA of {n} bytes beyond credit ({st.peer_credit_bytes} bytes, "
                f"{st.peer_credit_frames} frames)",
            )
        st.peer_credit_bytes -= n
        st.peer_credit_frames -= 1
        st.buffer.append(frame.payload)
        st.buffered += n
        return [DataReceived(st.id, n)]

    def _on_credit(self, frame: CreditFrame) -> list[Event]:
        if frame.stream_id == 0:  # the connection window
            self._conn_send += frame.bytes
            if self._conn_send > MAX_CREDIT:
                raise ProtocolError("connection credit overflow", ErrorCode.FLOW_CONTROL_ERROR)
            return [CreditGranted(0)]
        st = self._stream_for(frame.stream_id, "CREDIT")
        if st is None or not st.local_open:
            return []
        st.send_bytes += frame.bytes
        st.send_frames += frame.frames
        if st.send_bytes > MAX_CREDIT or st.send_frames > MAX_CREDIT:
            return self._stream_error(st, ErrorCode.FLOW_CONTROL_ERROR, "credit overflow")
        return [CreditGranted(st.id)]

    def _on_open(self, frame: OpenFrame) -> list[Event]:
        sid = frame.stream_id
        if self._is_local_id(sid):
            raise ProtocolError(f"peer opened stream {sid}, an id of our parity")
        if sid <= self._highest_remote_id:
            raise ProtocolError(f"peer reused or went back to stream id {sid}")
        if frame.window_bytes < 1 or frame.window_frames < 1:
            raise ProtocolError(f"OPEN of stream {sid} grants an empty window")
        self._highest_remote_id = sid
        if self.local_goaway:
            self._queue_control(
                encode_frame(ResetFrame(sid, ErrorCode.REFUSED_STREAM, "connection going away"))
            )
            return []
        limit = self.local_settings.max_streams
        if self.open_streams_by(local=False) >= limit:
            # Said as an event so that the I/O layer logs the refusal; the stream never opens.
            reason = f"too many open streams: {limit} already open on this connection"
            self._queue_control(encode_frame(ResetFrame(sid, ErrorCode.REFUSED_STREAM, reason)))
            return [StreamReset(sid, ErrorCode.REFUSED_STREAM, reason, by_peer=False)]
        self._streams[sid] = _Stream(
            sid,
            frame.label,
            send_bytes=frame.window_bytes,
            send_frames=frame.window_frames,
            window_bytes=self.local_settings.window_bytes,
            window_frames=self.local_settings.window_frames,
        )
        return [StreamOpened(sid, frame.label)]

    def _on_close(self, frame: CloseFrame) -> list[Event]:
        st = self._stream_for(frame.stream_id, "CLOSE")
        if st is None:
            return []
        if not st.remote_open:
            return self._stream_error(st, ErrorCode.STREAM_CLOSED, "second CLOSE")
        st.remote_open = False
        self._maybe_forget(st)
        return [StreamClosed(st.id)]

    def _on_reset(self, frame: ResetFrame) -> list[Event]:
        st = self._stream_for(frame.stream_id, "RESET")
        if st is None or st.finished:
            return []  # both sides already sent CLOSE: the data we hold is complete
        self._drop(st)
        return [StreamReset(st.id, frame.code, frame.reason, by_peer=True)]

    def _on_pong(self, frame: PongFrame) -> list[Event]:
        sent = self._pings.pop(frame.opaque, None)
        if sent is None:
            return []  # a PONG for a ping we gave up on, or unsolicited: harmless
        now = self._clock()
        self.last_pong_at = now
        rtt = now - sent
        self._rtt.add(rtt)
        return [PingAcked(rtt)]

    def _on_bye(self, frame: ByeFrame) -> list[Event]:
        reason = f"connection closed by peer: {frame.reason or frame.code.name}"
        events: list[Event] = []
        for st in list(self._streams.values()):
            if not st.finished:
                del self._streams[st.id]
                events.append(StreamReset(st.id, frame.code, reason, by_peer=True))
        self.closed = ConnectionTerminated(frame.code, frame.reason)
        self._control.clear()
        self._data.clear()
        events.append(self.closed)
        return events

    # ----- internals -----

    def _queue_control(self, frame: bytes) -> None:
        self._control.append(frame)
        self._control_bytes += len(frame)

    def _maybe_forget(self, st: _Stream) -> None:
        if st.finished and not st.buffer:
            self._streams.pop(st.id, None)
