"""`api/1` framing on the wire: bytes captured from the framer before it moved onto
`meshagent.wire.framing` (old and new agents must understand each other)."""

from __future__ import annotations

import pytest

from meshagent.api import forwarding
from meshagent.api.forwarding import ForwardError
from meshagent.wire.framing import LengthPrefixDecoder
from tests.net.scripted import ScriptedStream

# Produced by the old code: send_request("POST", "/v1/chat/completions", BODY) and the
# serving side's answer from APP (head message, then the raw body).
API_REQUEST = bytes.fromhex(
    "0000003da400010164504f535402742f76312f636861742f636f6d706c6574696f6e7303581b7b226d6f6465"
    "6c223a226d222c226d65737361676573223a5b5d7d"
)
API_RESPONSE = bytes.fromhex(
    "0000002fa300010118c80282824c636f6e74656e742d7479706551746578742f6576656e742d73747265616d"
    "8243782d614162646174613a2068690a0a"
)
BODY = b'{"model":"m","messages":[]}'
HEADERS = [(b"content-type", b"text/event-stream"), (b"x-a", b"b")]


async def APP(scope, receive, send):
    assert (scope["method"], scope["path"]) == ("POST", "/v1/chat/completions")
    assert (await receive())["body"] == BODY
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": b"data: hi\n\n", "more_body": False})


async def test_a_request_is_framed_as_before():
    stream = ScriptedStream()
    await forwarding.send_request(stream, "POST", "/v1/chat/completions", BODY)
    assert bytes(stream.sent) == API_REQUEST


async def test_an_old_request_is_served_and_answered_as_before():
    stream = ScriptedStream(*(API_REQUEST[i : i + 5] for i in range(0, len(API_REQUEST), 5)))
    await forwarding.serve_forwarded(stream, APP, peer_id="peer-a")
    assert bytes(stream.sent) == API_RESPONSE
    assert stream.eof_sent


async def test_an_old_response_head_is_read_and_the_body_start_kept():
    frames = LengthPrefixDecoder(forwarding.FRAMING)
    status, headers = await forwarding.read_response_head(ScriptedStream(API_RESPONSE), frames)
    assert (status, headers) == (200, HEADERS)
    assert frames.leftover() == b"data: hi\n\n"


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (API_RESPONSE[:10], "the peer closed the stream mid-message"),
        (b"", "the peer closed the stream mid-message"),
        ((forwarding.MAX_HEAD + 1).to_bytes(4, "big"), "over the 16777216-byte limit"),
    ],
)
async def test_a_cut_or_oversize_head_is_a_forward_error(data, error):
    with pytest.raises(ForwardError, match=error):
        await forwarding.read_response_head(
            ScriptedStream(data), LengthPrefixDecoder(forwarding.FRAMING)
        )
