import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.wire.errors import ErrorCode, ProtocolError
from meshagent.wire.sealed_records import HEADER_LEN, TAG_LEN, RecordReader, RecordSealer

KEY = bytes(range(32))


def read_all(reader: RecordReader) -> list[bytes]:
    out = []
    while (record := reader.next_record()) is not None:
        out.append(record)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=8), st.data())
def test_records_round_trip_whatever_the_read_boundaries(plaintexts, data):
    wire = RecordSealer(KEY).seal_many(plaintexts)
    reader = RecordReader(KEY)
    got = []
    pos = 0
    while pos < len(wire):
        step = data.draw(st.integers(1, max(1, len(wire) - pos)))
        reader.receive_data(bytes(wire[pos : pos + step]))
        pos += step
        got.extend(read_all(reader))
    assert got == plaintexts
    assert reader.buffered == 0


def test_nonces_never_repeat_so_equal_plaintexts_differ_on_the_wire():
    sealer = RecordSealer(KEY)
    first, second = sealer.seal(b"same"), sealer.seal(b"same")
    assert first != second
    assert sealer.records_sealed == 2


def test_every_tampered_byte_is_detected():
    sealer = RecordSealer(KEY)
    wire, following = sealer.seal(b"activation bytes" * 4), sealer.seal(b"next")
    for i in range(len(wire)):
        reader = RecordReader(KEY)
        reader.receive_data(wire[:i] + bytes([wire[i] ^ 0x01]) + wire[i + 1 :] + following)
        # Either refused now, or (a tampered length that claims more bytes) still waiting:
        # never a plaintext.
        try:
            assert reader.next_record() is None, f"tampered byte {i} was accepted"
        except ProtocolError:
            continue


def test_reordered_or_replayed_records_are_detected():
    sealer = RecordSealer(KEY)
    one, two = sealer.seal(b"one"), sealer.seal(b"two")
    reader = RecordReader(KEY)
    reader.receive_data(two + one)
    with pytest.raises(ProtocolError, match="authentication"):
        read_all(reader)
    reader = RecordReader(KEY)
    reader.receive_data(one + one)
    assert reader.next_record() == b"one"
    with pytest.raises(ProtocolError):
        reader.next_record()


def test_wrong_key_fails():
    reader = RecordReader(bytes(32))
    reader.receive_data(RecordSealer(KEY).seal(b"x"))
    with pytest.raises(ProtocolError):
        reader.next_record()


def test_oversized_record_is_refused_from_its_length_alone():
    reader = RecordReader(KEY, max_plaintext=1024)
    reader.receive_data((1024 + TAG_LEN + 1).to_bytes(HEADER_LEN, "big"))
    with pytest.raises(ProtocolError, match="exceeds the maximum") as info:
        reader.next_record()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(ProtocolError):  # stays failed
        reader.receive_data(b"more")


def test_plaintext_is_refused():
    reader = RecordReader(KEY)
    frame = b"\x02\x00\x00\x00\x01hello"
    reader.receive_data(len(frame).to_bytes(4, "big") + frame)
    with pytest.raises(ProtocolError):
        reader.next_record()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_raise_only_protocol_errors(data):
    reader = RecordReader(KEY)
    with contextlib.suppress(ProtocolError):
        reader.receive_data(data)
        read_all(reader)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=16), st.binary(max_size=3000)), max_size=6))
def test_head_body_pairs_seal_as_their_concatenation(pairs):
    joined = RecordSealer(KEY).seal_many([h + b for h, b in pairs])
    sealer = RecordSealer(KEY)
    out = bytearray(sealer.sealed_size(pairs) + 7)  # a reused buffer may be larger
    written = sealer.seal_into([(h, memoryview(b)) for h, b in pairs], out)
    assert written == len(joined) and out[:written] == joined
    assert sealer.records_sealed == len(pairs)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=8), st.data())
def test_records_round_trip_when_received_into_the_readers_buffer(plaintexts, data):
    wire = RecordSealer(KEY).seal_many(plaintexts)
    reader = RecordReader(KEY)
    got, pos = [], 0
    while pos < len(wire):
        room = reader.writable(data.draw(st.integers(1, 4096)))
        n = min(len(room), data.draw(st.integers(1, max(1, len(wire) - pos))))
        room[:n] = wire[pos : pos + n]
        reader.written(n)
        pos += n
        got.extend(read_all(reader))
    assert got == plaintexts and reader.buffered == 0


def test_an_oversized_length_does_not_grow_the_receive_buffer():
    reader = RecordReader(KEY, max_plaintext=1024)
    reader.receive_data((1 << 30).to_bytes(HEADER_LEN, "big"))
    assert len(reader.writable(64)) < 1 << 20
    with pytest.raises(ProtocolError):
        reader.next_record()
