import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving.sampling import SamplingParams, TokenLogprob
from meshagent.serving.stage_messages import (
    Close,
    Drop,
    Forward,
    ForwardItem,
    Keep,
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
        # A window with a draft, and one that follows it before its verdict (all draft).
        Forward((ForwardItem(2, 7, 1, True, ()), ForwardItem(0, 9, 2, True, (8, 9), True)), hidden),
        Forward((ForwardItem(2, 7, 3, True, (5, 6)),), hidden),
        Close(3),
        Token(2, 5, (), (6, 7)),
        Token(1, 4242, (0.5, 1.0, 3.75)),
        StageFailure(None, "stage 2 lost its model"),
        # Kept prefixes: keep a sequence's first positions, start another from them, free.
        Keep(3, 17, 120),
        Open(1, SamplingParams(), (4, 5), restore=(17, 119)),
        Drop((17, 2)),
        # A constrained sequence that reports logprobs, and its tokens with theirs.
        Open(4, SamplingParams(temperature=0.0, grammar='root ::= "a"', logprobs=2)),
        Open(5, SamplingParams(grammar="g", grammar_trigger="<t>", close_within=300)),
        Token(4, 7, (1.0,), (8,), (TokenLogprob(-0.5, ((7, -0.5), (9, -2.0))), TokenLogprob(-1.0))),
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


# Produced by the old code from the messages in golden_messages(), in that order.
STAGE_OPEN = bytes.fromhex(
    "33000000a400010101020303a500fb3fe666666666666601fb3feccccccccccccd020b03fb00000000000000"
    "0004fb0000000000000000"
)
STAGE_FORWARD_F32 = bytes.fromhex(
    "2f000000a700010102048284030a01f484010401f5056366333206040918200a82fb3ff8000000000000fb40"
    "02000000000000000000000000803f0000004000004040000080400000a0400000c0400000e040"
)
STAGE_FORWARD_F16 = bytes.fromhex(
    "17000000a700010102048184000002f50563663136060409100a800000003c004000420044004500460047"
)
STAGE_CLOSE = bytes.fromhex("07000000a3000101030203")
STAGE_TOKEN = bytes.fromhex(
    "28000000a5000101040201071910920a83fb3fe0000000000000fb3ff0000000000000fb400e000000000000"
)
STAGE_FAILURE = bytes.fromhex(
    "1f000000a40001010502f6087673746167652032206c6f737420697473206d6f64656c"
)


def golden_messages():
    hidden = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
    return [
        (Open(3, SamplingParams(temperature=0.7, top_p=0.9, seed=11)), STAGE_OPEN),
        (
            Forward(
                (ForwardItem(3, 10, 1, False), ForwardItem(1, 4, 1, True)), hidden, (1.5, 2.25)
            ),
            STAGE_FORWARD_F32,
        ),
        (Forward((ForwardItem(0, 0, 2, True),), hidden.astype(np.float16)), STAGE_FORWARD_F16),
        (Close(3), STAGE_CLOSE),
        (Token(1, 4242, (0.5, 1.0, 3.75)), STAGE_TOKEN),
        (StageFailure(None, "stage 2 lost its model"), STAGE_FAILURE),
    ]


def test_messages_are_framed_as_before():
    for msg, old in golden_messages():
        assert encode(msg) == old


def test_old_messages_decode_byte_by_byte():
    dec = StageDecoder()
    got = []
    for byte in b"".join(old for _, old in golden_messages()):
        got += dec.feed(bytes([byte]))
    assert all(same(m, g) for (m, _), g in zip(golden_messages(), got, strict=True))


def test_an_oversize_header_length_is_refused_before_its_body():
    with pytest.raises(StageProtocolError, match="stage header of 65537 bytes is over"):
        StageDecoder().feed((64 * 1024 + 1).to_bytes(4, "little"))


@pytest.mark.parametrize(
    "header",
    [
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0}, 16: [3]},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0}, 16: [3, 0]},
        {0: 1, 1: 6, 2: 0, 14: -1, 15: 3},
        {0: 1, 1: 7, 17: [1, "x"]},
        {0: 1, 1: 7, 17: 5},
        # sampling: a grammar is text, a logprobs count 0-20
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 5: 7}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 6: 21}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 6: True}},
        # token logprobs: one per token, each [logprob, [[id, logprob]...]]
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: []},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, []], [-2.0, []]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [["x", []]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, [[-3, -1.0]]]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, [[3, -1.0]] * 21]]},
    ],
)
def test_malformed_prefix_messages_are_refused(header):
    import cbor2

    from meshagent.serving.stage_messages import FRAMING

    with pytest.raises(StageProtocolError):
        StageDecoder().feed(FRAMING.encode(cbor2.dumps(header)))


@pytest.mark.parametrize(
    "item",
    [
        [0, 9, 2, True, [8], True],  # a window that follows is all draft
        [0, 9, 2, True, [8, 9], 1],  # the flag is true or absent
        [0, 9, 2, False, [8, 9], True],  # a draft is verified where a token is sampled
        [0, 9, 2, True, [8, 9]],  # a draft leaves the window's first token
    ],
)
def test_a_malformed_window_is_refused(item):
    import cbor2

    from meshagent.serving.stage_messages import _item_from_cbor

    with pytest.raises(StageProtocolError, match="bad"):
        _item_from_cbor(cbor2.loads(cbor2.dumps(item)))
