"""receive_frame: one length-prefixed frame from a trio stream, however the bytes arrive."""

from __future__ import annotations

import pytest

from meshagent.net.frame_reader import receive_frame
from meshagent.wire.errors import FramingError
from meshagent.wire.framing import Framing, LengthPrefixDecoder
from tests.net.scripted import ScriptedStream

FRAMING = Framing("test message", width=4, max_size=1 << 20)


class Closed(Exception):
    pass


def closed() -> Closed:
    return Closed("the peer closed the stream")


async def test_frames_split_across_receives_and_bytes_past_them_stay_buffered():
    data = FRAMING.encode(b"first") + FRAMING.encode(b"second") + b"rest"
    stream = ScriptedStream(data[:3], data[3:11], data[11:])
    frames = LengthPrefixDecoder(FRAMING)
    assert await receive_frame(stream, frames, on_eof=closed) == b"first"
    assert await receive_frame(stream, frames, on_eof=closed) == b"second"
    assert frames.leftover() == b"rest"


async def test_a_buffered_frame_is_returned_without_receiving():
    stream = ScriptedStream()
    frames = LengthPrefixDecoder(FRAMING, FRAMING.encode(b"ready"))
    assert await receive_frame(stream, frames, on_eof=closed) == b"ready"
    assert stream.receive_sizes == []


@pytest.mark.parametrize("data", [b"", b"\x00\x00", FRAMING.encode(b"cut short")[:-1]])
async def test_eof_before_a_whole_frame_raises_the_callers_error(data):
    stream = ScriptedStream(data)
    with pytest.raises(Closed, match="closed the stream"):
        await receive_frame(stream, LengthPrefixDecoder(FRAMING), on_eof=closed)


async def test_an_oversize_length_raises_the_framing_error_before_reading_its_body():
    stream = ScriptedStream((FRAMING.max_size + 1).to_bytes(4, "big"), b"never read")
    with pytest.raises(FramingError, match="over the 1048576-byte limit"):
        await receive_frame(stream, LengthPrefixDecoder(FRAMING), on_eof=closed)
    assert stream.chunks == [b"never read"]


async def test_receives_ask_for_the_rest_of_a_large_frame_at_once():
    big = b"x" * 200_000
    stream = ScriptedStream(FRAMING.encode(big))
    frames = LengthPrefixDecoder(FRAMING)
    assert await receive_frame(stream, frames, on_eof=closed, receive_size=65536) == big
    assert stream.receive_sizes == [65536, 200_000 + 4 - 65536]
    stream = ScriptedStream(FRAMING.encode(b"small"))
    await receive_frame(stream, LengthPrefixDecoder(FRAMING), on_eof=closed)
    assert stream.receive_sizes == [None]
