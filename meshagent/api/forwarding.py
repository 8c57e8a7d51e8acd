"""Carrying an API request to the peer that serves its model, over an overlay stream.

The asking agent's model directory opens a stream labelled `api/1` (`FORWARD_LABEL` in
`serving/directory.py`) to the peer serving the model; the asker sends one request message
(method, path, body) and keeps its side open: closing it means the client went away. The
serving agent runs the request through its own ASGI app and streams the response back as one
head message (status, headers) followed by the raw body, then ends its side. Streaming
responses (SSE) pass through unchanged, chunk by chunk.

A member of the mesh may ask only for inference this way (`api/access.py`, `PEER_PATHS`); the
app answers anything else with 403. The asker passes on to its client only the response
headers an answer of this API carries (`RELAYED_HEADERS`): a peer does not set cookies or
CORS rules on the asker's origin.
"""

from __future__ import annotations

from typing import Any

import cbor2
import structlog
import trio

from meshagent.errors import MeshError
from meshagent.net.framed import receive_frame
from meshagent.wire.framing import Framing, LengthPrefixDecoder

log = structlog.get_logger(__name__)

VERSION = 1
MAX_HEAD = 16 * 1024 * 1024  # a request body is at most 8 MiB
REQUEST_DEADLINE = 30.0  # seconds a peer has to send its request once it opened the stream
_LINGER = 30.0  # seconds the serving side waits for the asker to close after the response
# Response headers of this API (`api/exchange.py`, `api/errors.py`, the receipt of
# docs/api.md) that the asker relays; `x-meshagent-served-by` is the asker's to add.
RELAYED_HEADERS = frozenset(
    {
        b"content-type",
        b"cache-control",
        b"x-accel-buffering",
        b"retry-after",
        b"x-meshagent-stages",
        b"x-meshagent-wire-dtype",
        b"x-meshagent-wire-exact",
    }
)
_MAX_HEADER_VALUE = 8192


class ForwardError(MeshError):
    """The forwarded request could not be carried; the message says why."""


FRAMING = Framing("forwarded message", width=4, max_size=MAX_HEAD, error=ForwardError)


def _closed_mid_message() -> ForwardError:
    return ForwardError("the peer closed the stream mid-message")


async def _read_message(
    stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder
) -> dict[int, Any]:
    body = await receive_frame(stream, frames, on_eof=_closed_mid_message)
    try:
        msg = cbor2.loads(body)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise ForwardError(f"malformed forwarded message: {e}") from e
    if not isinstance(msg, dict) or msg.get(0) != VERSION:
        raise ForwardError("forwarded message of an unknown version or shape")
    return msg


def _message(fields: dict[int, Any]) -> bytes:
    return FRAMING.encode(cbor2.dumps({0: VERSION, **fields}))


async def send_request(stream: trio.abc.SendStream, method: str, path: str, body: bytes) -> None:
    await stream.send_all(_message({1: method, 2: path, 3: body}))


async def read_response_head(
    stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder
) -> tuple[int, list[tuple[bytes, bytes]]]:
    """The response's status and headers; body bytes read past them stay in `frames`
    (`frames.leftover()`)."""
    head = await _read_message(stream, frames)
    status, headers = head.get(1), head.get(2)
    if not isinstance(status, int) or not 200 <= status <= 599 or not isinstance(headers, list):
        raise ForwardError("malformed forwarded response head")
    if not all(
        isinstance(h, list) and len(h) == 2 and all(isinstance(x, bytes) for x in h)
        for h in headers
    ):
        raise ForwardError("malformed forwarded response headers")
    return status, [(k, v) for k, v in headers]


def relayed(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The peer's response headers that may reach the asker's client (`RELAYED_HEADERS`),
    each value a plain header value."""
    return [
        (name, value)
        for k, value in headers
        if (name := k.lower()) in RELAYED_HEADERS
        and len(value) <= _MAX_HEADER_VALUE
        and all(32 <= c < 127 or c == 9 for c in value)
    ]


async def serve_forwarded(stream: Any, app: Any, *, peer_id: str) -> None:
    """Answer one forwarded request on `stream` with the local ASGI `app`."""
    try:
        with trio.fail_after(REQUEST_DEADLINE):
            req = await _read_message(stream, LengthPrefixDecoder(FRAMING))
    except ForwardError as e:
        log.warning("forward.bad_request", peer=peer_id, error=str(e))
        return
    except trio.TooSlowError:
        log.warning(
            "forward.bad_request", peer=peer_id, error="no request", seconds=REQUEST_DEADLINE
        )
        return
    method, path, body = req.get(1), req.get(2), req.get(3)
    if not (isinstance(method, str) and isinstance(path, str) and isinstance(body, bytes)):
        log.warning("forward.bad_request", peer=peer_id, error="missing fields")
        return
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": (f"peer:{peer_id}", 0),
        "server": ("overlay", 0),
        "scheme": "http",
        "meshagent.forwarded_by": peer_id,
    }
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The asker keeps its side open until its client goes away.
        try:
            while await stream.receive_some():
                pass
        except trio.BrokenResourceError:
            pass
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [[bytes(k), bytes(v)] for k, v in message.get("headers", [])]
            await stream.send_all(_message({1: message["status"], 2: headers}))
        elif message["type"] == "http.response.body":
            data = message.get("body", b"")
            if data:
                await stream.send_all(data)
            if not message.get("more_body", False):
                await stream.send_eof()

    try:
        await app(scope, receive, send)
        # Let the asker read everything and close its side first: closing a stream whose
        # peer still sends resets it, and a reset drops what is still in flight.
        with trio.move_on_after(_LINGER):
            while await stream.receive_some():
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        log.info("forward.asker_gone", peer=peer_id, path=path)
