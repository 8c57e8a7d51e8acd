import contextlib

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.wire.control import decode_control, encode_control
from meshagent.wire.errors import ErrorCode, ProtocolError
from meshagent.wire.frames import (
    ByeFrame,
    CloseFrame,
    CreditFrame,
    DataFrame,
    FrameDecoder,
    FrameType,
    GoAwayFrame,
    OpenFrame,
    PingFrame,
    PongFrame,
    ResetFrame,
    decode_frame,
    encode_frame,
)
from meshagent.wire.sealed_records import RecordReader, RecordSealer

KEY = b"\x01" * 32
u32 = st.integers(0, 2**32 - 1)
sid = st.integers(1, 2**32 - 1)
codes = st.sampled_from(list(ErrorCode))
reason = st.text(max_size=100)

frames = st.one_of(
    st.builds(OpenFrame, sid, u32, u32, st.text(max_size=50)),
    st.builds(DataFrame, sid, st.binary(min_size=1, max_size=500)),
    st.builds(CreditFrame, sid, u32, u32),
    st.builds(CloseFrame, sid),
    st.builds(ResetFrame, sid, codes, reason),
    st.builds(GoAwayFrame, u32, codes, reason),
    st.builds(PingFrame, st.binary(min_size=8, max_size=8)),
    st.builds(PongFrame, st.binary(min_size=8, max_size=8)),
    st.builds(ByeFrame, codes, reason),
)


def normalised(frame):
    if isinstance(frame, DataFrame):
        return DataFrame(frame.stream_id, bytes(frame.payload))
    return frame


@settings(max_examples=300, deadline=None)
@given(frames)
def test_frames_round_trip(frame):
    assert normalised(decode_frame(encode_frame(frame))) == normalised(frame)


@settings(max_examples=50, deadline=None)
@given(st.lists(frames, max_size=10), st.integers(1, 64))
def test_decoder_yields_the_frames_sealed_in_order(sent, chunk):
    wire = bytes(RecordSealer(KEY).seal_many([encode_frame(f) for f in sent]))
    decoder = FrameDecoder(RecordReader(KEY))
    got = []
    for i in range(0, len(wire), chunk):
        decoder.receive_data(wire[i : i + chunk])
        while (f := decoder.next_frame()) is not None:
            got.append(normalised(f))
    assert got == [normalised(f) for f in sent]


def test_data_payload_is_raw_bytes_not_cbor():
    payload = bytes(range(256))
    raw = encode_frame(DataFrame(3, payload))
    assert raw == bytes([FrameType.DATA]) + (3).to_bytes(4, "big") + payload


def test_unknown_error_codes_from_newer_peers_read_as_internal_error():
    body = encode_control({1: 999, 2: "future"})
    frame = decode_frame(bytes([FrameType.RESET, 0, 0, 0, 1]) + body)
    assert frame == ResetFrame(1, ErrorCode.INTERNAL_ERROR, "future")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x02\x00\x00", "shorter than its header"),
        (b"\x02\x00\x00\x00\x00x", "DATA frame on stream 0"),
        (b"\x02\x00\x00\x00\x01", "empty DATA"),
        (b"\x07\x00\x00\x00\x01" + bytes(8), "must be on stream 0"),
        (b"\x07\x00\x00\x00\x00" + bytes(7), "8 bytes"),
        (b"\x03\x00\x00\x00\x01" + bytes(7), "CREDIT frame body must be 8 bytes"),
        (b"\x04\x00\x00\x00\x01x", "CLOSE frame must have an empty body"),
        (b"\x63\x00\x00\x00\x01", "unknown frame type"),
        (b"\x05\x00\x00\x00\x01\xff", "not valid CBOR"),
        (b"\x05\x00\x00\x00\x01" + cbor2.dumps([1, 2]), "not a map"),
        (b"\x05\x00\x00\x00\x01" + cbor2.dumps({0: 2, 1: 0}), "unsupported version"),
        (b"\x05\x00\x00\x00\x01" + cbor2.dumps({0: 1, 1: -1}), "unsigned"),
        (b"\x05\x00\x00\x00\x01" + cbor2.dumps({0: 1, 1: 0}) + b"\x00", "trailing"),
        (b"\x01\x00\x00\x00\x01" + cbor2.dumps({0: 1, 1: 1, 2: 1, 3: 5}), "text"),
        (b"\x06\x00\x00\x00\x00" + cbor2.dumps({0: 1, 1: 0, 2: "x"}), "field 3"),
    ],
)
def test_malformed_frames_raise_protocol_errors_naming_the_problem(raw, message):
    with pytest.raises(ProtocolError, match=message):
        decode_frame(raw)


# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# they raise ValueError, which would end the connection's reader (and what runs it).
huge = st.integers(4400, 5000).map(lambda n: 10**n)
wide = st.one_of(huge, huge.map(lambda v: -v))

cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | wide
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.integers(-2, 5), inner),
    max_leaves=10,
)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_plaintext_raises_only_protocol_errors(raw):
    with contextlib.suppress(ProtocolError):
        decode_frame(raw)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(list(FrameType)), st.integers(0, 2**32 - 1), cbor_values)
def test_frames_with_arbitrary_cbor_bodies_raise_only_protocol_errors(kind, stream_id, body):
    raw = bytes([kind]) + stream_id.to_bytes(4, "big") + cbor2.dumps(body)
    with contextlib.suppress(ProtocolError):
        decode_frame(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_control_decoder_raises_only_protocol_errors(raw):
    with contextlib.suppress(ProtocolError):
        decode_control(raw, "TEST")


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from([FrameType.OPEN, FrameType.RESET, FrameType.GOAWAY, FrameType.BYE]),
    st.one_of(wide, st.integers().filter(lambda v: v != 1)),
)
def test_a_control_frame_of_another_version_is_a_protocol_error(kind, version):
    stream_id = 0 if kind in (FrameType.GOAWAY, FrameType.BYE) else 1
    raw = bytes([kind]) + stream_id.to_bytes(4, "big") + cbor2.dumps({0: version, 1: 0})
    with pytest.raises(ProtocolError, match="unsupported version"):
        decode_frame(raw)


def test_deeply_nested_cbor_is_a_protocol_error_not_a_crash():
    raw = b"\x81" * 100_000 + b"\x00"
    with pytest.raises(ProtocolError):
        decode_control(raw, "TEST")
