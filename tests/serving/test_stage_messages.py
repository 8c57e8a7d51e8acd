import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving.sampling import SamplingParams
from meshagent.serving.stage_messages import (
    Close,
    Forward,
    ForwardItem,
    Open,
    StageDecoder,
    StageFailure,
    StageProtocolError,
    Token,
    encode,
)


def sample_messages():
    hidden = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    return [
        Open(3, SamplingParams(temperature=0.7, top_p=0.9, seed=11)),
        Forward((ForwardItem(3, 10, 2, False), ForwardItem(1, 4, 1, True)), hidden, (1.5, 2.25)),
        Forward((ForwardItem(0, 0, 3, True),), hidden.astype(np.float16)),
        Close(3),
        Token(1, 4242, (0.5, 1.0, 3.75)),
        StageFailure(None, "stage 2 lost its model"),
    ]


def same(a, b):
    if isinstance(a, Forward):
        return (
            a.items == b.items
            and a.timing == b.timing
            and a.hidden.dtype == b.hidden.dtype
            and np.array_equal(a.hidden, b.hidden)
        )
    return a == b


def test_round_trip_in_any_chunking():
    msgs = sample_messages()
    data = b"".join(encode(m) for m in msgs)
    for step in (1, 3, 7, len(data)):
        dec = StageDecoder()
        got = []
        for i in range(0, len(data), step):
            got += dec.feed(data[i : i + step])
        assert len(got) == len(msgs)
        assert all(same(a, b) for a, b in zip(msgs, got, strict=True))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_the_protocol_error(data):
    dec = StageDecoder()
    with contextlib.suppress(StageProtocolError):
        dec.feed(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.integers(0, 200), st.binary(min_size=1, max_size=8))
def test_corrupted_messages_raise_only_the_protocol_error(which, at, junk):
    data = bytearray(encode(sample_messages()[which]))
    at = min(at, len(data) - 1)
    data[at : at + len(junk)] = junk
    with contextlib.suppress(StageProtocolError):
        StageDecoder().feed(bytes(data))


def test_payload_size_must_match_the_items():
    msg = Forward((ForwardItem(0, 0, 2, True),), np.zeros((3, 4), np.float32))
    with pytest.raises(StageProtocolError, match="does not hold"):
        StageDecoder().feed(encode(msg))
