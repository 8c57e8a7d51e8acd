import contextlib

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshagent.serving import stage_messages as sm
from meshagent.serving.sampling import SamplingParams, TokenLogprob, seed_word
from meshagent.serving.stage_messages import (
    FRAMING,
    MAX_ID,
    Close,
    Drop,
    Forward,
    ForwardItem,
    Keep,
    Open,
    StageDecoder,
    StageFailure,
    StageLimits,
    StageProtocolError,
    Token,
    encode,
)

# What the tests' receivers hold (the samples fit them): a stage reads what comes from
# upstream, rows 8 wide; the entry reads what the last stage sends back.
LIMITS = StageLimits(slots=8, slot_ctx=256, n_vocab=5000, width=8)
REPLIES = StageLimits(slots=8, slot_ctx=256, n_vocab=5000)


def limits_for(msg) -> StageLimits:
    return REPLIES if isinstance(msg, Token) else LIMITS


def sample_messages():
    """Upstream messages first, then those back to the entry (a failure goes either way)."""
    hidden = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    return [
        Open(3, SamplingParams(temperature=0.7, top_p=0.9, seed=11)),
        Forward((ForwardItem(3, 10, 2, False), ForwardItem(1, 4, 1, True)), hidden, (1.5, 2.25)),
        Forward((ForwardItem(0, 0, 3, True),), hidden.astype(np.float16)),
        # A window with a draft, and one that follows it before its verdict (all draft).
        Forward((ForwardItem(2, 7, 1, True, ()), ForwardItem(0, 9, 2, True, (8, 9), True)), hidden),
        Forward((ForwardItem(2, 7, 3, True, (5, 6)),), hidden),
        Close(3),
        StageFailure(None, "stage 2 lost its model"),
        # Kept prefixes: keep a sequence's first positions, start another from them, free.
        Keep(3, 17, 120),
        Open(1, SamplingParams(), (4, 5), restore=(17, 119)),
        Drop((17, 2)),
        # A constrained sequence that reports logprobs, and its tokens with theirs.
        Open(4, SamplingParams(temperature=0.0, grammar='root ::= "a"', logprobs=2)),
        Open(5, SamplingParams(grammar="g", grammar_trigger="<t>", close_within=300)),
        Open(6, SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.1)),
        Token(2, 5, (), (6, 7)),
        Token(1, 4242, (0.5, 1.0, 3.75)),
        Token(4, 7, (1.0,), (8,), (TokenLogprob(-0.5, ((7, -0.5), (9, -2.0))), TokenLogprob(-1.0))),
        StageFailure(3, "sequence 3 was never opened"),
    ]


def carried_by(limits: StageLimits) -> list:
    """The samples a stream of this kind carries."""
    if limits is REPLIES:
        return [m for m in sample_messages() if isinstance(m, Token | StageFailure)]
    return [m for m in sample_messages() if not isinstance(m, Token)]


def same(a, b):
    if isinstance(a, Forward):
        return (
            a.items == b.items
            and a.timing == b.timing
            and a.hidden.dtype == b.hidden.dtype
            and np.array_equal(a.hidden, b.hidden)
        )
    return a == b


@pytest.mark.parametrize("limits", [LIMITS, REPLIES], ids=["upstream", "replies"])
def test_round_trip_in_any_chunking(limits):
    msgs = carried_by(limits)
    data = b"".join(encode(m) for m in msgs)
    for step in (1, 3, 7, len(data)):
        dec = StageDecoder(limits)
        got = []
        for i in range(0, len(data), step):
            got += dec.feed(data[i : i + step])
        assert len(got) == len(msgs)
        assert all(same(a, b) for a, b in zip(msgs, got, strict=True))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.sampled_from([LIMITS, REPLIES]))
def test_arbitrary_bytes_raise_only_the_protocol_error(data, limits):
    dec = StageDecoder(limits)
    with contextlib.suppress(StageProtocolError):
        dec.feed(data)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, len(sample_messages()) - 1),
    st.integers(0, 200),
    st.binary(min_size=1, max_size=8),
)
def test_corrupted_messages_raise_only_the_protocol_error(which, at, junk):
    msg = sample_messages()[which]
    data = bytearray(encode(msg))
    at = min(at, len(data) - 1)
    data[at : at + len(junk)] = junk
    with contextlib.suppress(StageProtocolError):
        StageDecoder(limits_for(msg)).feed(bytes(data))


def test_payload_size_must_match_the_items():
    msg = Forward((ForwardItem(0, 0, 2, True),), np.zeros((3, 8), np.float32))
    with pytest.raises(StageProtocolError, match="does not hold"):
        StageDecoder(LIMITS).feed(encode(msg))


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
    # (the golden hidden rows are 4 wide; Token and failure come back to the entry)
    upstream = StageDecoder(StageLimits(slots=8, slot_ctx=256, n_vocab=5000, width=4))
    replies = StageDecoder(REPLIES)
    got = []
    for msg, old in golden_messages():
        dec = replies if isinstance(msg, Token | StageFailure) else upstream
        for byte in old:
            got += dec.feed(bytes([byte]))
    assert all(same(m, g) for (m, _), g in zip(golden_messages(), got, strict=True))


def test_an_oversize_header_length_is_refused_before_its_body():
    with pytest.raises(StageProtocolError, match="stage header of 65537 bytes is over"):
        StageDecoder(LIMITS).feed((64 * 1024 + 1).to_bytes(4, "little"))


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
        # top_k a count of tokens; repeat_penalty a positive number
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 9: -1}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 9: 1.5}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 9: 2**40}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 10: 0.0}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 10: float("nan")}},
        {0: 1, 1: 1, 2: 0, 3: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0, 10: "x"}},
        # token logprobs: one per token, each [logprob, [[id, logprob]...]]
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: []},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, []], [-2.0, []]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [["x", []]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, [[-3, -1.0]]]]},
        {0: 1, 1: 4, 2: 0, 7: 5, 10: [], 18: [[-1.0, [[3, -1.0]] * 21]]},
    ],
)
def test_malformed_prefix_messages_are_refused(header):
    limits = REPLIES if header[1] == 4 else LIMITS
    with pytest.raises(StageProtocolError):
        StageDecoder(limits).feed(FRAMING.encode(cbor2.dumps(header)))


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
    from meshagent.serving.stage_messages import _item_from_cbor

    with pytest.raises(StageProtocolError, match="bad"):
        _item_from_cbor(cbor2.loads(cbor2.dumps(item)), LIMITS)


# ----- every value checked against what the receiver holds -----

SAMPLING = {0: 0.7, 1: 0.9, 2: 11, 3: 0.0, 4: 0.0}


def _raw(header: dict, payload: bytes = b"") -> bytes:
    return FRAMING.encode(cbor2.dumps({0: 1} | header)) + payload


def _history(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def _forward(items: list, rows: int | None = None, extra: dict | None = None) -> bytes:
    rows = sum(it[2] for it in items) if rows is None else rows
    payload = np.zeros((rows, 8), np.float32).tobytes()
    header = {1: 2, 4: items, 5: "f32", 6: 8, 9: len(payload), 10: []} | (extra or {})
    return _raw(header, payload)


def _token(fields: dict) -> bytes:
    return _raw({1: 4, 2: 1, 7: 5, 10: []} | fields)


def _open(fields: dict) -> bytes:
    return _raw({1: 1, 2: 1, 3: SAMPLING} | fields)


def _u32(v: int) -> int:
    """v as a u32 history id that is out of the vocabulary exactly where v is."""
    return v if 0 <= v < VOCAB else VOCAB + abs(v) % (2**32 - VOCAB)


# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# or str() they raise ValueError, not the protocol's error.
huge = st.integers(4400, 5000).map(lambda n: 10**n)


def _out_of(lo: int, hi: int):
    """Integers outside lo..hi (both included), as large as cbor carries and beyond."""
    return st.one_of(
        st.integers(max_value=lo - 1),
        st.integers(min_value=hi + 1),
        huge.map(lambda v: -v),
        huge,
    )


SLOTS, CTX, VOCAB = LIMITS.slots, LIMITS.slot_ctx, LIMITS.n_vocab
# Per message type, each integer field: (what, lowest, highest, the message with it as v).
FIELDS = [
    # Open
    ("open seq", 0, SLOTS - 1, lambda v: _open({2: v})),
    ("open seed", 0, 2**64 - 1, lambda v: _open({3: SAMPLING | {2: v}})),
    ("open logprobs", 0, 20, lambda v: _open({3: SAMPLING | {6: v}})),
    ("open closing budget", 1, MAX_ID, lambda v: _open({3: SAMPLING | {8: v}})),
    ("open restore entry", 0, MAX_ID, lambda v: _open({16: [v, 3]})),
    ("open restore length", 1, CTX, lambda v: _open({16: [7, v]})),
    (
        "open history size",
        0,
        4 * CTX,
        lambda v: _raw({1: 1, 2: 1, 3: SAMPLING, 11: True, 9: v}, bytes(min(max(v, 0), 5 * CTX))),
    ),
    (
        "open history id",
        0,
        VOCAB - 1,
        # (u32 on the wire: a value past the vocabulary is one of VOCAB..2**32-1)
        lambda v: _raw({1: 1, 2: 1, 3: SAMPLING, 11: True, 9: 8}, _history([3, _u32(v)])),
    ),
    # Forward
    ("forward seq", 0, SLOTS - 1, lambda v: _forward([[v, 0, 1, True]])),
    ("forward pos", 0, CTX - 2, lambda v: _forward([[0, v, 2, True]])),
    ("forward n", 1, CTX - 10, lambda v: _forward([[0, 10, v, True]], rows=min(max(v, 0), CTX))),
    ("forward draft id", 0, VOCAB - 1, lambda v: _forward([[0, 0, 3, True, [4, v]]])),
    ("forward width", 8, 8, lambda v: _forward([[0, 0, 1, True]], extra={6: v})),
    ("forward size", 32, 32, lambda v: _forward([[0, 0, 1, True]], extra={9: v})),
    ("forward layer", 0, MAX_ID, lambda v: _forward([[0, 0, 1, True]], extra={12: v})),
    # Close, Keep, Drop
    ("close seq", 0, SLOTS - 1, lambda v: _raw({1: 3, 2: v})),
    ("close size", 0, 0, lambda v: _raw({1: 3, 2: 0, 9: v})),
    ("keep seq", 0, SLOTS - 1, lambda v: _raw({1: 6, 2: v, 14: 1, 15: 16})),
    ("keep entry", 0, MAX_ID, lambda v: _raw({1: 6, 2: 0, 14: v, 15: 16})),
    ("keep length", 1, CTX, lambda v: _raw({1: 6, 2: 0, 14: 1, 15: v})),
    ("keep size", 0, 0, lambda v: _raw({1: 6, 2: 0, 14: 1, 15: 16, 9: v})),
    ("drop entry", 0, MAX_ID, lambda v: _raw({1: 7, 17: [1, v]})),
    ("drop size", 0, 0, lambda v: _raw({1: 7, 17: [1], 9: v})),
    # A failure, either way
    ("failure seq", 0, SLOTS - 1, lambda v: _raw({1: 5, 2: v, 8: "x"})),
    ("failure size", 0, 0, lambda v: _raw({1: 5, 2: None, 8: "x", 9: v})),
]
# Back to the entry
REPLY_FIELDS = [
    ("token seq", 0, SLOTS - 1, lambda v: _token({2: v})),
    ("token id", 0, VOCAB - 1, lambda v: _token({7: v})),
    ("token draft id", 0, VOCAB - 1, lambda v: _token({13: [3, v]})),
    ("token logprob id", 0, VOCAB - 1, lambda v: _token({18: [[-1.0, [[v, -1.0]]]]})),
    ("token size", 0, 0, lambda v: _token({9: v})),
    ("failure seq", 0, SLOTS - 1, lambda v: _raw({1: 5, 2: v, 8: "x"})),
]
CASES = [(LIMITS, *f) for f in FIELDS] + [(REPLIES, *f) for f in REPLY_FIELDS]


@pytest.mark.parametrize(("limits", "what", "lo", "hi", "make"), CASES, ids=[c[1] for c in CASES])
def test_every_integer_field_takes_its_whole_range(limits, what, lo, hi, make):
    for v in {lo, hi, (lo + hi) // 2}:
        assert len(StageDecoder(limits).feed(make(v))) == 1


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize(("limits", "what", "lo", "hi", "make"), CASES, ids=[c[1] for c in CASES])
def test_an_integer_field_out_of_range_is_refused_with_the_protocol_error(
    data, limits, what, lo, hi, make
):
    """Whatever the value, nothing but StageProtocolError, and before a payload is waited
    for: a header that announces more than its type holds is refused as it arrives."""
    v = data.draw(_out_of(lo, hi), label=what)
    with pytest.raises(StageProtocolError):
        StageDecoder(limits).feed(make(v))


@pytest.mark.parametrize(
    "header",
    [
        {1: 3, 2: 0, 9: 200 * 1024 * 1024},  # a Close may carry nothing
        {1: 1, 2: 0, 3: SAMPLING, 11: True, 9: 4 * CTX + 4},  # a history over a slot
        {1: 1, 2: 0, 3: SAMPLING, 9: 4},  # an Open without a history
    ],
)
def test_a_payload_over_what_its_type_holds_is_refused_before_it_comes(header):
    with pytest.raises(StageProtocolError, match="payload bytes"):
        StageDecoder(LIMITS).feed(_raw(header))  # the header alone


def test_a_forward_is_refused_on_its_header_when_it_does_not_fit_the_stage():
    # Rows wider than the stage's, more than the slots hold, or a size that is not them.
    huge = [[s, 0, CTX, True] for s in range(SLOTS)] + [[0, 0, 1, True]]
    for header, why in [
        ({1: 2, 4: [[0, 0, 1, True]], 5: "f32", 6: 4096, 9: 4096 * 4}, "4096 wide"),
        ({1: 2, 4: huge, 5: "f32", 6: 8, 9: 0}, "positions 0-255|over the"),
        ({1: 2, 4: [[0, 0, 1, True]], 5: "f32", 6: 8, 9: 1 << 28}, "does not hold"),
    ]:
        with pytest.raises(StageProtocolError, match=why):
            StageDecoder(LIMITS).feed(_raw(header))


@pytest.mark.parametrize(
    ("limits", "msg"),
    [
        (LIMITS, Token(0, 1)),  # tokens come from the last stage only
        (REPLIES, Close(0)),  # and nothing of the entry's goes back to it
        (REPLIES, Forward((ForwardItem(0, 0, 1, True),), np.zeros((1, 8), np.float32))),
    ],
)
def test_each_stream_takes_its_own_kinds_of_message(limits, msg):
    with pytest.raises(StageProtocolError, match="does not come"):
        StageDecoder(limits).feed(encode(msg))


@pytest.mark.parametrize(
    "sampling",
    [
        SAMPLING | {0: float("nan")},
        SAMPLING | {0: -1.0},
        SAMPLING | {1: 0.0},
        SAMPLING | {1: float("inf")},
        SAMPLING | {3: float("-inf")},
        SAMPLING | {2: 1.5},
        SAMPLING | {2: "12"},
        SAMPLING | {8: True},
        {0: 0.7, 1: 0.9},
    ],
)
def test_sampling_parameters_are_finite_and_of_their_types(sampling):
    with pytest.raises(StageProtocolError, match="sampling"):
        StageDecoder(LIMITS).feed(_open({3: sampling}))


@settings(max_examples=30, deadline=None)
@given(st.one_of(_out_of(1, 9), st.text(max_size=4), st.none()))
def test_a_message_type_out_of_range_is_refused_with_the_protocol_error(kind):
    for limits in (LIMITS, REPLIES):
        with pytest.raises(StageProtocolError, match="does not come"):
            StageDecoder(limits).feed(_raw({1: kind, 2: 0}))


# Each number field: the message with it as v (an integer no float holds is out of range).
NUMBER_FIELDS = [
    ("open temperature", LIMITS, lambda v: _open({3: SAMPLING | {0: v}})),
    ("open top_p", LIMITS, lambda v: _open({3: SAMPLING | {1: v}})),
    ("open presence penalty", LIMITS, lambda v: _open({3: SAMPLING | {3: v}})),
    ("open frequency penalty", LIMITS, lambda v: _open({3: SAMPLING | {4: v}})),
    ("forward timing", LIMITS, lambda v: _forward([[0, 0, 1, True]], extra={10: [1.0, v]})),
    ("token timing", REPLIES, lambda v: _token({10: [v]})),
    ("token logprob", REPLIES, lambda v: _token({18: [[v, [[3, -1.0]]]]})),
    ("token top logprob", REPLIES, lambda v: _token({18: [[-1.0, [[3, v]]]]})),
]


@settings(max_examples=30, deadline=None)
@given(value=st.one_of(st.just(10**400), st.integers(309, 5000).map(lambda n: -(10**n)), huge))
@pytest.mark.parametrize(
    ("what", "limits", "make"), NUMBER_FIELDS, ids=[f[0] for f in NUMBER_FIELDS]
)
def test_a_number_no_float_holds_is_refused_with_the_protocol_error(what, limits, make, value):
    assert len(StageDecoder(limits).feed(make(1))) == 1
    with pytest.raises(StageProtocolError):
        StageDecoder(limits).feed(make(value))


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 + 5, 2**64 - 1, 2**70 + 3])
def test_a_seed_of_any_size_or_sign_travels_as_the_bits_it_samples_with(seed):
    """An HTTP client's seed reaches the last stage as the 64 bits the sampler reads, so a
    seed that the entry took is never one its own chain refuses."""
    (msg,) = StageDecoder(LIMITS).feed(encode(Open(3, SamplingParams(temperature=0.7, seed=seed))))
    assert msg.sampling.seed == seed_word(seed)
    assert 0 <= msg.sampling.seed < 2**64


@pytest.mark.parametrize("kind", [sm.T_MOVED, sm.T_CONTINUE])
@pytest.mark.parametrize("move", [-1, 2**63, 1.5, "7", None])
def test_a_moves_id_is_a_non_negative_integer_below_2_63(kind, move):
    for limits in (LIMITS, REPLIES):
        with pytest.raises(StageProtocolError, match="move"):
            StageDecoder(limits).feed(_raw({1: kind, 19: move}))


def test_moved_and_continue_travel_both_ways():
    for msg in (sm.Moved(2**63 - 1), sm.Continue(0)):
        for limits in (LIMITS, REPLIES):
            assert StageDecoder(limits).feed(sm.encode(msg)) == [msg]
