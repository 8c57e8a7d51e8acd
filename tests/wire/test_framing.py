"""Length-prefixed framing: the sans-IO decoder, its limits, and any chunking of its input."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshagent.wire
from meshagent.errors import MeshError
from meshagent.wire.errors import FramingError
from meshagent.wire.framing import Framing, LengthPrefixDecoder

U16 = Framing("test frame", width=2, max_size=1000)
U32_LE = Framing("test frame", width=4, max_size=5000, byteorder="little")
FRAMINGS = st.sampled_from(
    [U16, U32_LE, Framing("f", width=1, max_size=200), Framing("f", width=8, max_size=9000)]
)


def bodies(framing: Framing):
    return st.lists(st.binary(max_size=min(framing.max_size, 300)), max_size=8)


def all_frames(decoder: LengthPrefixDecoder) -> list[bytes]:
    out = []
    while (frame := decoder.next_frame()) is not None:
        out.append(frame)
    return out


def test_encode_writes_the_length_in_the_framing_width_and_byte_order():
    assert U16.encode(b"abc") == b"\x00\x03abc"
    assert U32_LE.encode(b"abc") == b"\x03\x00\x00\x00abc"
    assert Framing("f", width=4, max_size=10).encode(b"") == b"\x00\x00\x00\x00"
    assert U16.encode(memoryview(b"xy")) == b"\x00\x02xy"


def test_encode_leaves_the_limit_to_the_receiver_but_check_applies_it():
    assert U16.encode(b"x" * 1001)[:2] == b"\x03\xe9"
    U16.check(1000)
    with pytest.raises(FramingError, match="test frame of 1001 bytes is over the 1000-byte limit"):
        U16.check(1001)
    with pytest.raises(OverflowError):
        Framing("f", width=1, max_size=10).encode(b"x" * 256)


def test_a_framing_is_validated_when_made():
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        Framing("f", width=3, max_size=10)
    with pytest.raises(ValueError, match="does not fit"):
        Framing("f", width=2, max_size=1 << 16)
    with pytest.raises(ValueError, match="byteorder"):
        Framing("f", width=2, max_size=10, byteorder="middle")  # type: ignore[arg-type]


def test_the_oversize_error_is_the_protocols_own():
    class Mine(MeshError):
        pass

    framing = replace(U16, what="my message", error=Mine)
    decoder = LengthPrefixDecoder(framing, b"\x03\xe9")
    with pytest.raises(Mine, match="my message of 1001 bytes is over the 1000-byte limit"):
        decoder.next_frame()
    assert issubclass(FramingError, MeshError)


def test_take_returns_raw_bytes_that_follow_a_frame():
    decoder = LengthPrefixDecoder(U16, U16.encode(b"head") + b"payload" + U16.encode(b"next"))
    assert decoder.next_frame() == b"head"
    assert decoder.take(100) is None
    assert decoder.take(0) == b""
    assert decoder.take(7) == b"payload"
    assert decoder.next_frame() == b"next"
    assert decoder.pending == 0


def test_leftover_hands_back_what_follows_the_last_frame():
    decoder = LengthPrefixDecoder(U16)
    decoder.feed(U16.encode(b"spliced") + b"\x00\x05abc")
    assert decoder.next_frame() == b"spliced"
    assert decoder.pending == 5
    assert decoder.leftover() == b"\x00\x05abc"
    assert decoder.pending == 0 and decoder.next_frame() is None


def test_needed_counts_the_bytes_still_missing():
    decoder = LengthPrefixDecoder(U32_LE)
    assert decoder.needed == 4
    decoder.feed(b"\x0a\x00")
    assert decoder.needed == 2
    decoder.feed(b"\x00\x00abc")
    assert decoder.needed == 7
    decoder.feed(b"defghij" + b"more")
    assert decoder.needed == 0
    assert decoder.next_frame() == b"abcdefghij"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_chunking_yields_the_same_frames(data):
    framing = data.draw(FRAMINGS)
    frames = data.draw(bodies(framing))
    stream = b"".join(framing.encode(f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = LengthPrefixDecoder(framing)
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        decoder.feed(stream[a:b])
        got += all_frames(decoder)
    assert got == frames
    assert decoder.pending == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_truncated_frame_yields_nothing_until_it_is_complete(data):
    framing = data.draw(FRAMINGS)
    body = data.draw(st.binary(max_size=min(framing.max_size, 300)))
    encoded = framing.encode(body)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    decoder = LengthPrefixDecoder(framing, encoded[:cut])
    assert decoder.next_frame() is None
    assert decoder.pending == cut
    # Until the length is in, only the rest of the prefix is known to be needed.
    missing = len(encoded) - cut if cut >= framing.width else framing.width - cut
    assert decoder.needed == missing
    decoder.feed(encoded[cut:])
    assert decoder.next_frame() == body


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_an_oversize_length_raises_before_its_body_arrives(data):
    framing = data.draw(FRAMINGS)
    size = data.draw(st.integers(framing.max_size + 1, (1 << (8 * framing.width)) - 1))
    body_part = data.draw(st.binary(max_size=50))
    good = data.draw(st.binary(max_size=min(framing.max_size, 50)))
    decoder = LengthPrefixDecoder(framing, framing.encode(good))
    decoder.feed(size.to_bytes(framing.width, framing.byteorder) + body_part)
    assert decoder.next_frame() == good
    with pytest.raises(FramingError, match=f"of {size} bytes is over"):
        decoder.next_frame()


@settings(max_examples=300, deadline=None)
@given(FRAMINGS, st.binary(max_size=300))
def test_arbitrary_bytes_give_frames_or_the_framing_error_only(framing, data):
    decoder = LengthPrefixDecoder(framing, data)
    try:
        frames = all_frames(decoder)
    except FramingError:
        return
    assert sum(framing.width + len(f) for f in frames) + decoder.pending == len(data)


def test_the_wire_package_imports_no_trio():
    """Sans-IO: the wire layer's state machines never import the I/O library."""
    offenders = []
    for path in Path(meshagent.wire.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "trio"]
    assert offenders == []
