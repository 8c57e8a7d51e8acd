"""Carrying an API request to the peer that serves its model, over an overlay stream.

The asking agent's model directory opens a stream labelled `api/1` (`FORWARD_LABEL` in
`serving/directory.py`) to the peer serving the model; the asker sends one request message
(method, path, body) and keeps its side open: closing it means the client went away. The
serving agent runs the request through its own ASGI app and streams the response back as one
head message (status, headers) followed by the raw body, then ends its side. Streaming
responses (SSE) pass through unchanged, chunk by chunk.

Each side checks what the other sends once, where it decodes it: the serving side a request
(`decode_request`: the version, an HTTP method, a path, a body within the API's limit), the
asking side a head (`decode_head`: a status of 200-599, a few headers of bytes, in at most
`MAX_RESPONSE_HEAD` bytes). Anything else is a `ForwardError` that names the field and ends
that stream.

A member of the mesh may ask only for inference this way (`api/access.py`, `PEER_PATHS`); the
app answers anything else with 403. The asker passes on to its client only the response
headers an answer of this API carries (`RELAYED_HEADERS`): a peer does not set cookies or
CORS rules on the asker's origin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import cbor2
import structlog
import trio

from meshagent.api.exchange import MAX_BODY
from meshagent.errors import MeshError
from meshagent.net.frame_reader import receive_frame
from meshagent.wire.framing import Framing, LengthPrefixDecoder
from meshagent.wire.quoted import quoted

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
# What an asker sends (`OpenAIApp._forward`: the method and path its client used), bounded
# far above any path this API has; the app answers what it does not serve.
_METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,16}")  # an HTTP token
MAX_PATH = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A response head is a status and the few headers of this API: far under this.
MAX_RESPONSE_HEAD = 64 * 1024
MAX_HEADERS = 64


class ForwardError(MeshError):
    """The forwarded request could not be carried; the message says why."""


FRAMING = Framing("forwarded message", width=4, max_size=MAX_HEAD, error=ForwardError)


def _closed_mid_message() -> ForwardError:
    return ForwardError("the peer closed the stream mid-message")


async def _read_frame(stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder) -> bytes:
    return await receive_frame(stream, frames, on_eof=_closed_mid_message)


def _fields(body: bytes, what: str) -> dict[Any, Any]:
    """A message's CBOR map of this version; ForwardError naming what is wrong."""
    try:
        msg = cbor2.loads(body)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise ForwardError(f"malformed forwarded {what}: {e}") from e
    if not isinstance(msg, dict):
        raise ForwardError(f"a forwarded {what} is a map, not {quoted(msg)}")
    version = msg.get(0)
    if type(version) is not int or version != VERSION:  # True and 1.0 equal 1
        raise ForwardError(f"forwarded {what} of version {quoted(version)}, not {VERSION}")
    return msg


def _message(fields: dict[int, Any]) -> bytes:
    return FRAMING.encode(cbor2.dumps({0: VERSION, **fields}))


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    body: bytes


def decode_request(body: bytes) -> ForwardedRequest:
    """A request message as the serving side takes it: every field what an asker sends;
    ForwardError naming the field and its value otherwise."""
    msg = _fields(body, "request")
    method, path, data = msg.get(1), msg.get(2), msg.get(3)
    if not isinstance(method, str) or not _METHOD.fullmatch(method):
        raise ForwardError(f"forwarded request method {quoted(method)} is not an HTTP method")
    if (
        not isinstance(path, str)
        or not path.startswith("/")
        or len(path) > MAX_PATH
        or _CONTROL.search(path)
    ):
        raise ForwardError(
            f"forwarded request path {quoted(path)} is not a path of at most {MAX_PATH} characters"
        )
    if not isinstance(data, bytes) or len(data) > MAX_BODY:
        shown = f"of {len(data)} bytes" if isinstance(data, bytes) else quoted(data)
        raise ForwardError(
            f"forwarded request body {shown} is not bytes of at most {MAX_BODY} bytes"
        )
    return ForwardedRequest(method, path, data)


def decode_head(body: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """A response head as the asking side takes it: a status of 200-599 and at most
    `MAX_HEADERS` headers, name and value bytes; ForwardError naming what is not."""
    if len(body) > MAX_RESPONSE_HEAD:
        raise ForwardError(
            f"forwarded response head of {len(body)} bytes is over the "
            f"{MAX_RESPONSE_HEAD}-byte limit"
        )
    head = _fields(body, "response head")
    status, headers = head.get(1), head.get(2)
    if type(status) is not int or not 200 <= status <= 599:
        raise ForwardError(f"forwarded response status {quoted(status)} is not 200-599")
    if not isinstance(headers, list) or len(headers) > MAX_HEADERS:
        shown = f"{len(headers)} of them" if isinstance(headers, list) else quoted(headers)
        raise ForwardError(
            f"forwarded response headers ({shown}) are not a list of at most {MAX_HEADERS}"
        )
    for h in headers:
        if not (isinstance(h, list) and len(h) == 2 and all(type(x) is bytes for x in h)):
            raise ForwardError(
                f"forwarded response headers hold {quoted(h)}, not a [name, value] of bytes"
            )
    return status, [(k, v) for k, v in headers]


async def send_request(stream: trio.abc.SendStream, method: str, path: str, body: bytes) -> None:
    await stream.send_all(_message({1: method, 2: path, 3: body}))


async def read_response_head(
    stream: trio.abc.ReceiveStream, frames: LengthPrefixDecoder
) -> tuple[int, list[tuple[bytes, bytes]]]:
    """The response's status and headers (`decode_head`); body bytes read past them stay in
    `frames` (`frames.leftover()`)."""
    return decode_head(await _read_frame(stream, frames))


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
            req = decode_request(await _read_frame(stream, LengthPrefixDecoder(FRAMING)))
    except ForwardError as e:
        log.warning("forward.bad_request", peer=peer_id, error=str(e))
        return
    except trio.TooSlowError:
        log.warning(
            "forward.bad_request", peer=peer_id, error="no request", seconds=REQUEST_DEADLINE
        )
        return
    method, path, body = req.method, req.path, req.body
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
