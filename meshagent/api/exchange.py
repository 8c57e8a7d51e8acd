"""One HTTP request/response over ASGI: body reading, JSON and SSE responses, disconnects."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from meshagent.api.errors import ApiError, bad_request
from meshagent.serving.directory import Headers

MAX_BODY = 8 * 1024 * 1024

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


# ASGI's callables (https://asgi.readthedocs.io): the next message from the server, one to it,
# and an application.
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request was read."""


class Exchange:
    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.started = False
        self.status: int | None = None  # what the response started with
        self.finished = False
        self.disconnected = False
        self.sse = False  # the response is a stream of server-sent events
        self.raw_body = b""

    async def json_body(self) -> object:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"Request body is larger than {MAX_BODY} bytes.")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        raw = b"".join(chunks)
        self.raw_body = raw
        if not raw:
            raise bad_request("The request body is empty; send a JSON object.")
        try:
            return json.loads(raw)
        except ValueError as e:  # not JSON, not UTF-8, or an integer past 4300 digits
            raise bad_request(
                f"We could not parse the JSON body of your request ({e}). "
                "Send valid JSON with Content-Type: application/json."
            ) from e

    async def watch_disconnect(self, scope: trio.CancelScope) -> None:
        """Cancel `scope` as soon as the client goes away."""
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                scope.cancel()
                return

    async def send_json(self, status: int, body: object, headers: Headers | None = None) -> None:
        data = json.dumps(body).encode()
        await self._start(status, JSON_HEADERS + (headers or []))
        await self._body(data, more=False)

    async def send_error(self, err: ApiError) -> None:
        await self.send_json(err.status, err.body(), err.headers())

    async def start_sse(self, headers: Headers | None = None) -> None:
        self.sse = True
        await self._start(200, SSE_HEADERS + (headers or []))

    async def send_comment(self, text: str) -> None:
        """An SSE comment (clients skip it): keeps an idle stream's connection alive."""
        await self._body(f": {text}\n\n".encode(), more=True)

    async def send_event(self, payload: object) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await self._body(f"data: {data}\n\n".encode(), more=True)

    async def send_named_event(self, name: str, payload: object) -> None:
        """An SSE event with an `event:` line (Anthropic's streams name each event)."""
        await self._body(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode(), more=True)

    async def end(self) -> None:
        await self._body(b"", more=False)

    async def start(self, status: int, headers: Headers) -> None:
        await self._start(status, headers)

    async def send_raw(self, data: bytes) -> None:
        await self._body(data, more=True)

    async def send_bytes(self, status: int, body: bytes, content_type: str) -> None:
        await self._start(status, [(b"content-type", content_type.encode())])
        await self._body(body, more=False)

    async def _start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, data: bytes, *, more: bool) -> None:
        if not more:
            self.finished = True
        if self.disconnected:
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


# An endpoint's handler, and a protocol module's endpoints by (method, path).
Handler = Callable[[Exchange], Awaitable[None]]
Routes = dict[tuple[str, str], Handler]
