"""Driving an ASGI app in process: one request, its answer collected (no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

HOST = (b"host", b"127.0.0.1:9400")
JSON = (b"content-type", b"application/json")


@dataclass
class Answer:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.encode()]
        return found[0].decode() if found else None

    def names(self) -> set[str]:
        return {k.decode().lower() for k, _ in self.headers}

    def json(self) -> Any:
        return json.loads(self.body)


async def call(
    app: Any,
    method: str,
    path: str,
    *,
    headers: Iterable[tuple[bytes, bytes]] = (HOST, JSON),
    body: bytes | dict[str, Any] = b"",
    gone: trio.Event | None = None,
) -> Answer:
    """`app`'s answer to one request; the client stays until `gone` is set (if given)."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    answer = Answer()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if gone is None:
            await trio.sleep_forever()
        else:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": list(headers),
    }
    await app(scope, receive, send)
    return answer


async def call_and(
    app: Any, method: str, path: str, then: Callable[[], None], *, after: float, body: dict
) -> Answer:
    """`app`'s answer to one request, `then` called `after` seconds into it."""
    answer: list[Answer] = []

    async def ask() -> None:
        answer.append(await call(app, method, path, body=body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.sleep(after)
        then()
    return answer[0]
