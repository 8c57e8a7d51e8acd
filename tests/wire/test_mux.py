import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.wire.errors import ErrorCode, LocalUsageError, ProtocolError
from meshagent.wire.events import (
    ConnectionTerminated,
    CreditGranted,
    DataReceived,
    GoAway,
    PingAcked,
    StreamClosed,
    StreamOpened,
    StreamReset,
)
from meshagent.wire.frames import CloseFrame, CreditFrame, DataFrame, OpenFrame, ResetFrame
from meshagent.wire.settings import StreamSettings
from tests.wire.pairs import mux_pair, pump

SMALL = StreamSettings(window_bytes=1000, window_frames=4, max_frame_payload=300)


def read_everything(mux, sid):
    """Everything buffered right now (reads return one frame at a time)."""
    out = b""
    while chunk := mux.read(sid, 1 << 30):
        out += chunk
    return out


def test_open_send_close_round_trip_in_both_directions():
    a, b, _ = mux_pair()
    sid = a.open_stream("stage")
    assert sid % 2 == 1
    assert a.send_data(sid, b"hello") == 5
    a.send_eof(sid)
    events = pump(a, b)
    assert events == [StreamOpened(sid, "stage"), DataReceived(sid, 5), StreamClosed(sid)]
    assert b.read(sid, 100) == b"hello"
    assert b.read(sid, 100) == b""
    assert b.send_data(sid, b"reply") == 5
    b.send_eof(sid)
    pump(b, a)
    assert read_everything(a, sid) == b"reply"
    assert a.open_streams == 0 and b.open_streams == 0
    # The responder opens even-numbered streams.
    sid2 = b.open_stream("back")
    assert sid2 % 2 == 0
    assert pump(b, a) == [StreamOpened(sid2, "back")]


def test_sender_stops_at_the_window_and_resumes_when_the_receiver_reads():
    a, b, _ = mux_pair(SMALL, SMALL)
    sid = a.open_stream()
    payload = bytes(range(256)) * 20  # 5120 bytes against a 1000-byte window
    assert a.send_data(sid, payload) == 1000  # 300 + 300 + 300 + 100: window and 4 frames
    pump(a, b)
    assert a.send_data(sid, payload[1000:]) == 0  # no credit: takes nothing, no error
    assert a.send_credit(sid) == (0, 0)
    assert b.buffered(sid) == 1000  # bounded by the window
    got = b.read(sid, 600)  # one frame (300 bytes) per read
    assert len(got) == 300 and pump(b, a) == []  # less than half the window: no grant yet
    got += b.read(sid, 600)
    events = pump(b, a)
    assert events == [CreditGranted(sid)]
    total = 1000
    while total < len(payload):
        n = a.send_data(sid, payload[total:])
        pump(a, b)
        got += read_everything(b, sid)
        pump(b, a)
        assert b.buffered(sid) <= SMALL.window_bytes
        total += n
    got += read_everything(b, sid)
    assert got == payload


def test_frame_window_limits_many_small_messages():
    settings = StreamSettings(window_bytes=1 << 20, window_frames=2)
    a, b, _ = mux_pair(settings, settings)
    sid = a.open_stream()
    assert a.send_data(sid, b"x") == 1
    assert a.send_data(sid, b"y") == 1
    assert a.send_data(sid, b"z") == 0
    pump(a, b)
    assert b.read(sid, 1) == b"x"
    assert pump(b, a) == [CreditGranted(sid)]
    assert a.send_data(sid, b"z") == 1


def test_stream_window_can_be_chosen_per_stream():
    a, b, _ = mux_pair()
    sid = a.open_stream(window_bytes=10, window_frames=1)
    pump(a, b)
    assert b.send_data(sid, b"0123456789abc") == 10
    assert b.send_data(sid, b"abc") == 0


def test_data_beyond_credit_resets_only_that_stream():
    a, b, _ = mux_pair(SMALL, SMALL)
    good, bad = a.open_stream(), a.open_stream()
    pump(a, b)
    events = b.handle_frame(DataFrame(bad, b"x" * 300))
    for _ in range(3):
        events += b.handle_frame(DataFrame(bad, b"x" * 300))
    events += b.handle_frame(DataFrame(bad, b"x" * 300))  # 5th frame: beyond 4 / 1000
    assert events[-1] == StreamReset(
        bad, ErrorCode.FLOW_CONTROL_ERROR, events[-1].reason, by_peer=False
    )
    assert "beyond credit" in events[-1].reason
    assert pump(b, a)[-1] == StreamReset(
        bad, ErrorCode.FLOW_CONTROL_ERROR, events[-1].reason, by_peer=True
    )
    assert a.send_data(good, b"still fine") == 10
    assert pump(a, b) == [DataReceived(good, 10)]


def test_data_in_flight_after_a_reset_is_ignored():
    a, b, _ = mux_pair()
    sid = a.open_stream()
    pump(a, b)
    b.reset(sid, ErrorCode.CANCEL, "not interested")
    assert b.handle_frame(DataFrame(sid, b"late")) == []
    assert b.handle_frame(CloseFrame(sid)) == []


def test_frames_for_never_opened_streams_are_connection_errors():
    _a, b, _ = mux_pair()
    with pytest.raises(ProtocolError, match="never opened"):
        b.handle_frame(DataFrame(7, b"x"))
    with pytest.raises(ProtocolError, match="never opened"):
        b.handle_frame(CreditFrame(2, 1, 1))  # our own parity, not yet opened by us


def test_open_with_wrong_parity_or_reused_id_is_a_connection_error():
    _a, b, _ = mux_pair()
    with pytest.raises(ProtocolError, match="parity"):
        b.handle_frame(OpenFrame(2, 10, 1))
    b.handle_frame(OpenFrame(5, 10, 1))
    with pytest.raises(ProtocolError, match="reused"):
        b.handle_frame(OpenFrame(3, 10, 1))


def test_data_after_close_resets_the_stream():
    a, b, _ = mux_pair()
    sid = a.open_stream()
    a.send_eof(sid)
    pump(a, b)
    events = b.handle_frame(DataFrame(sid, b"late"))
    assert events[0].code == ErrorCode.STREAM_CLOSED


def test_goaway_refuses_new_streams_but_existing_ones_continue():
    a, b, _ = mux_pair()
    old = a.open_stream()
    pump(a, b)
    b.go_away(ErrorCode.REPLACED, "replaced")
    events = pump(b, a)
    assert events == [GoAway(old, ErrorCode.REPLACED, "replaced")]
    with pytest.raises(LocalUsageError, match="GOAWAY"):
        a.open_stream()
    with pytest.raises(LocalUsageError, match="going away"):
        b.open_stream()
    assert a.send_data(old, b"more") == 4
    assert pump(a, b) == [DataReceived(old, 4)]


def test_stream_opened_after_goaway_crossed_is_refused_and_retryable():
    a, b, _ = mux_pair()
    b.go_away()
    sid = a.open_stream()  # a has not seen the GOAWAY yet
    pump(a, b)
    events = pump(b, a)
    assert StreamReset(sid, ErrorCode.REFUSED_STREAM, "connection going away", True) in events


def test_too_many_streams_are_refused():
    limited = StreamSettings(max_streams=2)
    a, b, _ = mux_pair(StreamSettings(), limited)
    a.open_stream(), a.open_stream()
    with pytest.raises(LocalUsageError, match="at most 2"):
        a.open_stream()
    # A peer that ignores the limit gets its stream refused.
    pump(a, b)
    b.handle_frame(OpenFrame(5, 10, 1))
    assert b.frames_to_send()  # a RESET went out
    assert b.open_streams == 2


def test_ping_measures_rtt():
    a, b, clock = mux_pair()
    a.ping()
    pump(a, b)
    clock.now = 0.150
    assert pump(b, a) == [PingAcked(pytest.approx(0.150))]
    a.ping()
    pump(a, b)
    clock.now = 0.150 + 0.050
    pump(b, a)
    rtt = a.rtt
    assert rtt.latest == pytest.approx(0.050)
    assert rtt.smoothed == pytest.approx(0.150 + (0.050 - 0.150) / 8)
    assert rtt.minimum == pytest.approx(0.050)
    assert rtt.samples == 2
    assert a.last_pong_at == pytest.approx(0.2)


def test_control_frames_go_before_queued_data():
    a, _b, _ = mux_pair()
    sid = a.open_stream()
    a.frames_to_send()
    a.send_data(sid, b"x" * 1000)
    a.ping()
    first = a.frames_to_send()[0]
    assert first[0] == 7  # PING


def test_close_resets_open_streams_and_sends_bye_after_queued_data():
    a, b, _ = mux_pair()
    done, open_ = a.open_stream(), a.open_stream()
    a.send_eof(done)
    pump(a, b)
    b.send_eof(done)
    pump(b, a)
    a.send_data(open_, b"last words")
    resets = a.close(ErrorCode.REPLACED, "replaced")
    assert resets == [StreamReset(open_, ErrorCode.REPLACED, "replaced", by_peer=False)]
    events = pump(a, b)
    assert events[-1] == ConnectionTerminated(ErrorCode.REPLACED, "replaced")
    assert StreamReset(open_, ErrorCode.REPLACED, "replaced", by_peer=True) in events
    with pytest.raises(LocalUsageError):
        a.open_stream()


def test_bye_resets_unfinished_streams_with_the_reason():
    a, b, _ = mux_pair()
    sid = a.open_stream()
    pump(a, b)
    b.close(ErrorCode.SHUTDOWN, "node stopping")
    b._control.clear()  # lose the RESETs: BYE alone must still fail the stream
    events = pump(b, a)
    assert events[0] == StreamReset(
        sid, ErrorCode.SHUTDOWN, "connection closed by peer: node stopping", by_peer=True
    )
    assert events[-1] == ConnectionTerminated(ErrorCode.SHUTDOWN, "node stopping")


def test_reset_by_peer_after_both_sides_closed_keeps_complete_data():
    a, b, _ = mux_pair()
    sid = a.open_stream()
    a.send_data(sid, b"complete")
    a.send_eof(sid)
    pump(a, b)
    b.send_eof(sid)
    assert b.handle_frame(ResetFrame(sid, ErrorCode.CANCEL, "late")) == []
    assert read_everything(b, sid) == b"complete"


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 8),
    st.integers(1, 700),
    st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 4000)), min_size=1, max_size=40),
)
def test_any_interleaving_delivers_every_byte_in_order_within_the_window(
    window_bytes, window_frames, max_payload, steps
):
    settings = StreamSettings(
        window_bytes=window_bytes, window_frames=window_frames, max_frame_payload=max_payload
    )
    a, b, _ = mux_pair(settings, settings)
    sid = a.open_stream()
    payload = bytes(i % 251 for i in range(sum(n for n, _ in steps)))
    sent = 0
    got = bytearray()
    for send_n, read_n in steps:
        sent += a.send_data(sid, payload[sent : sent + send_n])
        pump(a, b)
        assert b.buffered(sid) <= window_bytes
        got += b.read(sid, read_n) or b""
        pump(b, a)
    while sent < len(payload) or b.buffered(sid):
        progress = a.send_data(sid, payload[sent:])
        sent += progress
        pump(a, b)
        chunk = read_everything(b, sid)
        got += chunk
        pump(b, a)
        assert progress or chunk, "stalled although the receiver read everything"
    assert bytes(got) == payload


def test_sent_data_is_what_the_buffer_held_at_send_time():
    a, b, _ = mux_pair()
    sid = a.open_stream()
    pump(a, b)
    mutable, immutable = bytearray(b"before"), b"kept as is"
    a.send_data(sid, mutable)
    a.send_data(sid, memoryview(immutable)[5:])
    mutable[:] = b"AFTER!"  # the caller may reuse its buffer once send_data returns
    events = pump(a, b)
    assert [type(e) for e in events] == [DataReceived, DataReceived]
    assert b.read(sid, 100) == b"before" and b.read(sid, 100) == b"as is"


# ----- the connection window -----

BUDGET = StreamSettings(
    window_bytes=1000, window_frames=16, max_frame_payload=300, connection_window_bytes=1500
)


def test_the_connection_window_bounds_what_all_streams_together_may_send():
    # Three streams of 1000-byte windows, one 1500-byte budget for the connection: the
    # receiver never buffers more than 1500, and a reader frees room for every stream.
    a, b, _ = mux_pair(BUDGET, BUDGET)
    sids = [a.open_stream() for _ in range(3)]
    sent = [a.send_data(sid, bytes(1000)) for sid in sids]
    assert sent == [1000, 500, 0]
    assert a.send_credit(sids[2]) == (0, 16)
    pump(a, b)
    assert sum(b.buffered(sid) for sid in sids) == 1500
    assert b.connection_credit == (1500, 0)  # the peer may send nothing more
    read = len(read_everything(b, sids[0]))  # 1000 bytes read: over half the budget
    assert read == 1000
    events = pump(b, a)
    assert CreditGranted(0) in events
    # Stream 3 goes on with the room; credit returns in batches of at least half the budget
    # (the 900 bytes of three reads; the fourth read's 100 wait for the next batch).
    assert a.send_data(sids[2], bytes(1000)) == 900
    pump(a, b)
    assert sum(b.buffered(sid) for sid in sids) <= 1500


def test_bytes_dropped_with_a_stream_return_to_the_connection_window():
    a, b, _ = mux_pair(BUDGET, BUDGET)
    sid = a.open_stream()
    assert a.send_data(sid, bytes(1000)) == 1000
    pump(a, b)
    b.reset(sid, ErrorCode.CANCEL, "not wanted")  # 1000 unread bytes go with the stream
    events = pump(b, a)
    assert CreditGranted(0) in events
    assert a.connection_credit[0] == 1500
    # Data for a stream that has ended is dropped, and its credit comes back too.
    other = a.open_stream()
    pump(a, b)
    b.reset(other, ErrorCode.CANCEL, "gone")  # before its data arrives
    assert a.send_data(other, bytes(900)) == 900
    pump(a, b)
    pump(b, a)
    assert a.connection_credit[0] == 1500


def test_data_beyond_the_connection_window_is_a_connection_error():
    tight = StreamSettings(
        window_bytes=1000, window_frames=16, max_frame_payload=300, connection_window_bytes=500
    )
    a, b, _ = mux_pair(tight, tight)
    sid = a.open_stream()
    pump(a, b)
    b.handle_frame(DataFrame(sid, bytes(300)))
    with pytest.raises(ProtocolError, match="connection window") as e:
        b.handle_frame(DataFrame(sid, bytes(300)))  # within the stream's window, not the budget
    assert e.value.code is ErrorCode.FLOW_CONTROL_ERROR


def test_settings_carry_the_connection_window_and_a_peer_without_one_sets_no_limit():
    s = StreamSettings(connection_window_bytes=1 << 20)
    assert StreamSettings.from_cbor(s.to_cbor()) == s
    old = {k: v for k, v in s.to_cbor().items() if k != 5}
    assert StreamSettings.from_cbor(old).connection_window_bytes == (1 << 32) - 1
    with pytest.raises(ValueError):
        StreamSettings(max_frame_payload=1000, connection_window_bytes=999)
