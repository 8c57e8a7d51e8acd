"""`gen/1` messages on their own: every kind round-trips, a continuation's fields travel only
when there is one, a carried error keeps its shape, and bytes that are not a message are
refused with a reason (never another exception)."""

from __future__ import annotations

import contextlib

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshagent.api.errors import ApiError, from_body, unavailable
from meshagent.api.forwarding import FRAMING
from meshagent.api.gen_messages import Ask, Fail, GenMessageError, Head, decode, encode
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
        Ask("POST", "/v1/chat/completions", b"{}", (5, 0, 2**40), 17, 2**62),
        Ask("POST", "/v1/completions", b"{}", seed=-3),
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
    ],
)
def test_messages_round_trip(msg):
    assert decode(_body(encode(msg))) == msg


def test_a_fresh_ask_carries_no_continuation():
    fresh = cbor2.loads(_body(encode(Ask("POST", "/v1/completions", b"{}"))))
    assert sorted(fresh) == [0, 1, 2, 3, 4]
    cont = cbor2.loads(_body(encode(Ask("POST", "/v1/completions", b"{}", (7,), 1, 5))))
    assert (cont[5], cont[6], cont[7]) == ([7], 1, 5)


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


@given(st.text(), st.lists(st.integers(0, 2**32 - 1), max_size=20))
def test_any_delta_round_trips(text, tokens):
    delta = Delta(text, tuple(tokens))
    assert decode(_body(encode(delta))) == delta
