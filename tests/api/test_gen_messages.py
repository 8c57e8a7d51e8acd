"""`gen/1` messages on their own: every kind round-trips, a continuation's fields travel only
when there is one, a carried error keeps its shape, and bytes that are not a message, or
whose integers are out of their ranges, are refused with a reason (never another
exception)."""

from __future__ import annotations

import contextlib
import math
import struct

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.api.errors import ApiError, from_body, unavailable
from meshagent.api.gen_messages import (
    COUNTS,
    FRAMING,
    MAX_SHARE,
    RETRY_AFTER,
    SEEDS,
    STATUSES,
    TICKETS,
    TOKEN_IDS,
    Ask,
    Embedded,
    Fail,
    GenMessageError,
    Head,
    Moved,
    Rejoin,
    Vector,
    decode,
    encode,
)
from meshagent.serving.generation import Delta, Finished, Logprob, Replay, Speculation
from meshagent.wire.framing import LengthPrefixDecoder


def _body(data: bytes) -> bytes:
    frames = LengthPrefixDecoder(FRAMING)
    frames.feed(data)
    body = frames.next_frame()
    assert body is not None and frames.leftover() == b""
    return body


@pytest.mark.parametrize(
    "msg",
    [
        Ask("POST", "/v1/completions", b'{"a": 1}'),
        Ask("POST", "/v1/chat/completions", b"{}", (5, 0, 2**31 - 1), 17, 2**64 - 1),
        Ask("POST", "/v1/completions", b"{}", seed=0),
        Head([(b"x-meshagent-stages", b"a:0-30")], "m", 99, 12, "echo"),
        Head([], "m", None, 3),
        Delta("héllo", (1, 2, 3)),
        Delta("", ()),
        Delta(
            "ab", (5, 6), (Logprob(b"a", -0.25, ((b"a", -0.25), (b"\xff", -3.5))), Logprob(b"b", 0))
        ),
        Finished("stop", 10, 20, (1.5, 2.25), (Replay("lost", 30, 1200.5, 800.0),)),
        Finished("length", 1, 2, (), (Replay("a", 3, 4.0, 1.0, ("p:0-10", "q:10-30")),)),
        Finished("stop", 4, 9, (), (), Speculation(3, 12, 7)),
        Finished("stop", 4, 9, (), (), Speculation(3, 12, 7, 1, 2, 8, 5, "SmolLM2-135M")),
        Finished("stop", 4, 9, (), (), None, 2, "\n\nUser:"),
        Ask("POST", "/v1/completions", b"{}", seed=5, share="0123abcd"),
        Ask("POST", "/v1/completions", b"{}", ticket=2**63 - 1),
        Rejoin(1),
        Moved(),
        Vector((0.1, -1 / 3, 1e-300, 2.0**60)),
        Embedded("m", 12),
    ],
)
def test_messages_round_trip(msg):
    assert decode(_body(encode(msg))) == msg


def test_a_fresh_ask_carries_no_continuation():
    fresh = cbor2.loads(_body(encode(Ask("POST", "/v1/completions", b"{}"))))
    assert sorted(fresh) == [0, 1, 2, 3, 4]
    cont = cbor2.loads(_body(encode(Ask("POST", "/v1/completions", b"{}", (7,), 1, 5))))
    assert (cont[5], cont[6], cont[7]) == ([7], 1, 5)


def test_a_done_names_a_stop_string_of_bounded_text():
    done = {0: 1, 1: "done", 2: "stop", 3: 4, 4: 9, 5: [], 6: []}
    with pytest.raises(GenMessageError):
        decode(cbor2.dumps({**done, 9: "x" * 5000}))
    with pytest.raises(GenMessageError):
        decode(cbor2.dumps({**done, 9: 7}))
    assert decode(cbor2.dumps({**done, 9: "\n\nUser:"})).stop == "\n\nUser:"


def test_a_done_names_its_draft_model_in_bounded_text_with_counts_in_range():
    done = {0: 1, 1: "done", 2: "stop", 3: 4, 4: 9, 5: [], 6: []}
    counts = [3, 12, 7, 1, 2, 8, 5]
    with pytest.raises(GenMessageError):
        decode(cbor2.dumps({**done, 7: [*counts, "x" * 300]}))
    with pytest.raises(GenMessageError):
        decode(cbor2.dumps({**done, 7: [*counts, 7]}))
    with pytest.raises(GenMessageError):
        decode(cbor2.dumps({**done, 7: [3, 12, 7, 1, -2, 8, 5, "d"]}))
    spec = decode(cbor2.dumps({**done, 7: [*counts, "d"]})).speculation
    assert spec is not None and (spec.model_drafted, spec.draft_model) == (8, "d")


@pytest.mark.parametrize(
    "fields,why",
    [
        ({2: b""}, "whole number"),
        ({2: b"\x00" * 12}, "whole number"),
        ({2: struct.pack("<2d", 1.0, math.nan)}, "not finite"),
        ({2: struct.pack("<d", math.inf)}, "not finite"),
        ({2: [1.0, 2.0]}, "expected bytes"),
    ],
    ids=["empty", "cut-short", "nan", "inf", "not-bytes"],
)
def test_a_vector_is_whole_float64s_every_one_finite(fields, why):
    with pytest.raises(GenMessageError, match=why):
        decode(cbor2.dumps({0: 1, 1: "vector", **fields}))


def test_a_share_key_is_short_text():
    ask = {0: 1, 1: "ask", 2: "POST", 3: "/v1/completions", 4: b"{}", 8: "k" * MAX_SHARE}
    assert decode(cbor2.dumps(ask)).share == "k" * MAX_SHARE
    for bad in ("k" * (MAX_SHARE + 1), 7, b"key"):
        with pytest.raises(GenMessageError):
            decode(cbor2.dumps({**ask, 8: bad}))


def test_a_seed_travels_as_the_64_bits_the_sampler_reads():
    for seed, sent in ((-3, 2**64 - 3), (2**70 + 5, 5), (7, 7)):
        assert decode(_body(encode(Ask("POST", "/v1/completions", b"{}", seed=seed)))).seed == sent
        assert decode(_body(encode(Head([], "m", seed, 1)))).seed == sent


def test_a_carried_error_keeps_its_shape_and_its_retry_after():
    for err in (
        ApiError(429, "busy", "requests", None, "rate_limit_exceeded"),
        unavailable("gone", code="shutting_down", retry_after=5),
    ):
        got = decode(_body(encode(Fail(err, True))))
        assert got == Fail(err, True)
    assert from_body(500, {"nope": 1}).status == 500  # an error body of no known shape


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe",
        b"\x80",
        b"\xa1\x00\x02",
        b"\xa2\x00\x01\x01\x64nope",
        b"\xa2\x00\x01\x01\x65delta",
        cbor2.dumps({0: 1, 1: "delta", 2: "x", 3: [True]}),
        cbor2.dumps({0: 1, 1: "head", 2: [], 3: 5, 4: None, 5: 1, 6: ""}),
    ],
    ids=[
        "garbage",
        "not-a-map",
        "wrong-version",
        "unknown-kind",
        "missing-fields",
        "bool-token",
        "model-not-text",
    ],
)
def test_malformed_messages_are_refused_with_a_reason(body):
    with pytest.raises(GenMessageError):
        decode(body)


@given(st.binary(max_size=64))
def test_any_bytes_decode_to_a_message_or_a_clear_error(data):
    with contextlib.suppress(GenMessageError):  # anything else fails the test
        decode(data)


@given(st.text(), st.lists(st.integers(0, 2**31 - 1), max_size=20))
def test_any_delta_round_trips(text, tokens):
    delta = Delta(text, tuple(tokens))
    assert decode(_body(encode(delta))) == delta


# ----- every integer field of every kind, out of its range -----

VALID = {
    "ask": Ask("POST", "/v1/completions", b"{}", (5, 7), 3, 11, ticket=7),
    "rejoin": Rejoin(9),
    "head": Head([(b"x-meshagent-stages", b"a:0-30")], "m", 99, 12),
    "fail": Fail(unavailable("gone", retry_after=5), True),
    "delta": Delta("ab", (5, 6)),
    "done": Finished(
        "stop", 10, 20, (1.5,), (Replay("lost", 30, 1.0, 0.5),), Speculation(3, 12, 7, 2), 4
    ),
}

# Where each integer sits in its kind's map (keys and list indices), and its range.
INT_FIELDS = [
    ("ask", (5, 0), TOKEN_IDS),
    ("ask", (5, 1), TOKEN_IDS),
    ("ask", (6,), COUNTS),
    ("ask", (7,), SEEDS),
    ("ask", (9,), TICKETS),
    ("rejoin", (2,), TICKETS),
    ("head", (4,), SEEDS),
    ("head", (5,), COUNTS),
    ("fail", (2,), STATUSES),
    ("fail", (4,), RETRY_AFTER),
    ("delta", (3, 0), TOKEN_IDS),
    ("delta", (3, 1), TOKEN_IDS),
    ("done", (3,), COUNTS),
    ("done", (4,), COUNTS),
    ("done", (6, 0, 1), COUNTS),
    *(("done", (7, i), COUNTS) for i in range(4)),
    ("done", (8,), COUNTS),
]


def _map(kind: str) -> dict:
    return cbor2.loads(_body(encode(VALID[kind])))


def _with(kind: str, path: tuple[int, ...], value: object) -> bytes:
    m = _map(kind)
    *outer, last = path
    holder = m
    for k in outer:
        holder = holder[k]
    holder[last] = value
    return cbor2.dumps(m)


def _int_paths(v: object, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if isinstance(v, dict):
        return [p for k, x in v.items() if k != 0 for p in _int_paths(x, (*path, k))]
    if isinstance(v, list):
        return [p for i, x in enumerate(v) for p in _int_paths(x, (*path, i))]
    return [path] if isinstance(v, int) and not isinstance(v, bool) else []


def test_the_table_names_every_integer_of_every_kind():
    listed = sorted((kind, path) for kind, path, _ in INT_FIELDS)
    assert listed == sorted((kind, p) for kind in VALID for p in _int_paths(_map(kind)))


@pytest.mark.parametrize("kind,path,allowed", INT_FIELDS)
def test_each_range_holds_its_ends(kind, path, allowed):
    for v in (allowed.start, allowed.stop - 1):
        decode(_with(kind, path, v))


# Integers past the 4300 digits Python prints (a CBOR bignum of some 2 KB): quoted with repr()
# or str() they raise ValueError, and the refusal would name that, not the field.
huge = st.integers(4400, 5000).map(lambda n: 10**n)


def _outside(allowed: range) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(max_value=allowed.start - 1),
        st.integers(min_value=allowed.stop),
        huge,
        huge.map(lambda v: -v),
        st.sampled_from([allowed.start - 1, allowed.stop, -(2**63), 2**64, -(2**200), 2**200]),
    )


@given(
    st.sampled_from(INT_FIELDS).flatmap(
        lambda f: st.tuples(st.just(f), st.one_of(_outside(f[2]), st.floats(), st.booleans()))
    )
)
def test_an_integer_out_of_its_range_is_refused_with_the_protocols_error(case):
    (kind, path, _), value = case
    with pytest.raises(GenMessageError) as refused:
        decode(_with(kind, path, value))
    if type(value) is int:  # named for what it is, however wide
        assert " is outside " in str(refused.value)


@given(st.one_of(st.just(10**400), st.integers(309, 5000).map(lambda n: -(10**n)), huge))
def test_a_number_no_float_holds_is_refused_as_what_it_is(value):
    for path, what in [((5, 0), "duration"), ((6, 0, 2), "duration"), ((6, 0, 3), "duration")]:
        with pytest.raises(GenMessageError, match=what):
            decode(_with("done", path, value))
    delta = _map("delta") | {4: [[b"a", value, []]]}
    with pytest.raises(GenMessageError, match="log-probability"):
        decode(cbor2.dumps(delta))


@given(st.one_of(huge, st.integers(), st.binary(max_size=8)))
def test_an_unknown_kind_or_tool_syntax_is_refused_as_what_it_is(value):
    with pytest.raises(GenMessageError, match="unknown gen/1 message kind"):
        decode(cbor2.dumps(_map("ask") | {1: value}))
    with pytest.raises(GenMessageError, match="unknown tool-call syntax"):
        decode(_with("head", (7,), value))


@pytest.mark.parametrize(
    "kind,path",
    [("ask", (4,)), ("head", (2, 0, 0)), ("head", (2, 0, 1))],
    ids=["ask-body", "header-name", "header-value"],
)
def test_a_number_where_bytes_belong_is_refused_not_allocated(kind, path):
    with pytest.raises(GenMessageError):
        decode(_with(kind, path, 2**26))  # a 9-byte field: 64 MiB as `bytes(n)`


@pytest.mark.parametrize(
    "header",
    [[b"set-cookie", b"a=b"], [b"x-meshagent-stages", b"a\r\nset-cookie: a=b"], [b"X-Other", b"1"]],
)
def test_a_receipt_carries_only_meshagents_own_headers(header):
    with pytest.raises(GenMessageError):
        decode(_with("head", (2, 0), header))


@pytest.mark.parametrize("ms", [float("nan"), float("inf"), -1.0, "5"])
def test_a_duration_is_a_finite_number_of_milliseconds(ms):
    for path in ((5, 0), (6, 0, 2), (6, 0, 3)):
        with pytest.raises(GenMessageError):
            decode(_with("done", path, ms))
