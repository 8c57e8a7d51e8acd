"""A request answered by one of the agent's own endpoints, run in process, for an endpoint
that speaks another protocol over it (`api/responses.py`, `api/ollama.py`): what the handler
sends comes back on a channel, SSE events decoded."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange


class InnerExchange:
    """A request to `path` run in process: its status, then each SSE event's JSON (or the
    whole body of a reply that is not a stream), sent on a channel as ("start", status),
    ("event", data) or ("body", bytes)."""

    def __init__(
        self, outer: Exchange, path: str, body: bytes, out: trio.MemorySendChannel
    ) -> None:
        self.outer, self.path, self.body, self.out = outer, path, body, out
        self.gone = trio.Event()  # the outer client left: the handler hears a disconnect
        self._buffer = b""
        self._sse = False

    async def run(self, handler: Callable[[Exchange], Awaitable[None]]) -> None:
        scope = {**self.outer.scope, "path": self.path, "raw_path": self.path.encode()}
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.gone.wait()  # `relay_disconnect` watches the outer client
            return {"type": "http.disconnect"}

        async with self.out:
            ex = Exchange(scope, receive, self._send)
            try:
                await handler(ex)
            except ApiError as e:
                if not ex.started:
                    await ex.send_error(e)

    async def _send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            headers = dict(msg.get("headers", []))
            self._sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            await self.out.send(("start", msg["status"]))
            return
        data = msg.get("body", b"")
        if not self._sse:
            self._buffer += data
            if not msg.get("more_body"):
                await self.out.send(("body", self._buffer))
            return
        self._buffer += data
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    await self.out.send(("event", json.loads(line[6:])))


async def relay_disconnect(outer: Exchange, inner: InnerExchange) -> None:
    """When `outer`'s client leaves, `inner`'s handler hears it as its own client leaving
    (and stops, and counts it so)."""
    with trio.CancelScope() as scope:
        await outer.watch_disconnect(scope)
    inner.gone.set()


async def first_status(chunks: trio.MemoryReceiveChannel) -> int:
    async for kind, value in chunks:
        if kind == "start":
            return int(value)
    return 502


async def error_body(chunks: trio.MemoryReceiveChannel) -> bytes:
    async for kind, value in chunks:
        if kind == "body":
            return bytes(value)
    return json.dumps({"error": {"message": "no answer", "type": "server_error"}}).encode()
