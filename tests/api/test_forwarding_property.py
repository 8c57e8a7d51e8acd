"""`api/1` with generated values for every field: the serving side runs a request through its
app only when every field is what an asker sends (else it logs the field and answers
nothing), and the asking side reads a response head or raises ForwardError naming the field;
no input makes either raise anything else."""

from __future__ import annotations

import contextlib
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from meshagent.api import forwarding
from meshagent.api.forwarding import ForwardError
from meshagent.wire.framing import LengthPrefixDecoder
from tests.net.scripted import ScriptedStream
from tests.peer_values import any_cbor, not_an_int, wide_ints

REQUEST = {0: 1, 1: "POST", 2: "/v1/chat/completions", 3: b"{}"}
HEAD = {0: 1, 1: 200, 2: [[b"content-type", b"application/json"]]}
MIB = 1 << 20

not_text = st.one_of(
    st.integers(-(2**70), 2**70), wide_ints, not_an_int.filter(lambda v: not isinstance(v, str))
)
not_bytes = st.one_of(
    st.integers(-(2**70), 2**70),
    st.just(2**26),  # as `bytes(n)`: 64 MiB of zeros
    wide_ints,
    not_an_int.filter(lambda v: not isinstance(v, bytes)),
)

# What each request field may not be: (field name in the error, key, values).
REQUEST_FIELDS = {
    "version": (
        0,
        st.one_of(
            st.integers().filter(lambda v: v != 1),
            wide_ints,
            st.sampled_from([True, 1.0, "1", b"\x01", None]),
            not_an_int,
        ),
    ),
    "method": (
        1,
        st.one_of(
            not_text,
            st.sampled_from(["", "POST " * 4, "PO ST", "POST\r\n", "P" * 17, "X" * (4 * MIB)]),
        ),
    ),
    "path": (
        2,
        st.one_of(
            not_text,
            st.sampled_from(
                ["", "v1/completions", "/v1/\x00", "/a\r\nb", "/" + "a" * 5000, "/" * (4 * MIB)]
            ),
        ),
    ),
    "body": (3, st.one_of(not_bytes, st.just(b"x" * (8 * MIB + 1)))),
}


def frame(fields: dict[Any, Any]) -> bytes:
    return forwarding.FRAMING.encode(cbor2.dumps(fields))


class SpyApp:
    """An ASGI app that answers 200 and remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, Any, Any]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = (await receive())["body"]
        self.asked.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def serve(fields: dict[Any, Any]) -> tuple[SpyApp, ScriptedStream, list[dict[str, Any]]]:
    app, stream = SpyApp(), ScriptedStream(frame(fields))
    with capture_logs() as logs:
        await forwarding.serve_forwarded(stream, app, peer_id="p33r")
    return app, stream, logs


@pytest.mark.parametrize("field", REQUEST_FIELDS)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
async def test_a_request_field_out_of_range_never_reaches_the_app(field, data):
    key, values = REQUEST_FIELDS[field]
    value = data.draw(values, label=field)
    app, stream, logs = await serve({**REQUEST, key: value})
    assert app.asked == [] and stream.sent == b""
    refused = [e for e in logs if e["event"] == "forward.bad_request"]
    assert refused and field in refused[0]["error"], refused


@pytest.mark.parametrize("missing", [0, 1, 2, 3])
async def test_a_request_without_a_field_never_reaches_the_app(missing):
    app, stream, _ = await serve({k: v for k, v in REQUEST.items() if k != missing})
    assert app.asked == [] and stream.sent == b""


async def test_a_request_within_every_range_reaches_the_app():
    body = b"x" * (8 * MIB)
    app, stream, _ = await serve({**REQUEST, 2: "/" + "a" * 4000, 3: body})
    assert app.asked == [("POST", "/" + "a" * 4000, body)]
    assert stream.sent.endswith(b"{}") and stream.eof_sent


cbor_values = any_cbor(4)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 4), cbor_values, max_size=5))
async def test_any_request_map_is_served_or_refused_never_raised(fields):
    app, _, _ = await serve(fields)
    for method, path, body in app.asked:
        assert isinstance(method, str) and isinstance(path, str) and isinstance(body, bytes)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
async def test_any_request_bytes_are_served_or_refused_never_raised(data):
    stream = ScriptedStream(forwarding.FRAMING.encode(data))
    await forwarding.serve_forwarded(stream, SpyApp(), peer_id="p33r")


# ----- the response head, as the asking side reads it ---------------------------------------


def header_lists() -> st.SearchStrategy[Any]:
    pair = st.lists(st.binary(max_size=8), min_size=2, max_size=2)
    return st.one_of(
        st.integers(-(2**70), 2**70),
        wide_ints,
        not_an_int.filter(lambda v: not isinstance(v, list)),
        st.lists(st.one_of(not_bytes, not_text), min_size=1, max_size=3),  # not pairs
        st.lists(pair, max_size=2).map(lambda h: [*h, [b"x-a", "text"]]),
        st.lists(pair, max_size=2).map(lambda h: [*h, [b"x-a", b"b", b"c"]]),
        st.lists(pair, max_size=2).map(lambda h: [*h, [1, b"b"]]),
        st.just([[b"x-a", b"b"]] * 1000),
    )


HEAD_FIELDS = {
    "version": (0, REQUEST_FIELDS["version"][1]),
    "status": (
        1,
        st.one_of(
            st.integers(max_value=199),
            st.integers(min_value=600),
            wide_ints,
            st.sampled_from([True, False, 200.0, "200", b"200", None]),
            not_an_int,
        ),
    ),
    "headers": (2, header_lists()),
}


async def read_head(data: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    return await forwarding.read_response_head(
        ScriptedStream(data), LengthPrefixDecoder(forwarding.FRAMING)
    )


@pytest.mark.parametrize("field", HEAD_FIELDS)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
async def test_a_head_field_out_of_range_is_a_forward_error_naming_it(field, data):
    key, values = HEAD_FIELDS[field]
    value = data.draw(values, label=field)
    with pytest.raises(ForwardError, match=field):
        await read_head(frame({**HEAD, key: value}))


async def test_an_oversized_head_is_refused_before_it_is_decoded():
    huge = {**HEAD, 2: [[b"x-a", b"b" * 70_000]]}  # one header over the head's 64 KiB
    with pytest.raises(ForwardError, match="head"):
        await read_head(frame(huge))
    many = {**HEAD, 2: [[b"", b""]] * 300_000}  # many tiny ones: objects, not bytes
    with pytest.raises(ForwardError, match="head"):
        await read_head(frame(many))


async def test_a_head_within_every_range_is_read():
    headers = [[b"x-meshagent-stages", b"a" * 8192]] * 6
    for status in (200, 599):
        assert await read_head(frame({**HEAD, 1: status, 2: headers})) == (
            status,
            [(k, v) for k, v in headers],
        )


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 4), cbor_values, max_size=5))
async def test_any_head_map_is_read_or_a_forward_error(fields):
    with contextlib.suppress(ForwardError):
        status, headers = await read_head(frame(fields))
        assert type(status) is int and 200 <= status <= 599
        assert all(type(k) is bytes and type(v) is bytes for k, v in headers)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
async def test_any_head_bytes_are_read_or_a_forward_error(data):
    with contextlib.suppress(ForwardError):
        await read_head(forwarding.FRAMING.encode(data))
