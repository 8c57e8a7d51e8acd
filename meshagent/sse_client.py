"""Server-sent events as a client reads them (the `text/event-stream` format): a sans-IO decoder,
lines or bytes in and events out, the events of an httpx streaming response, and the text of
an OpenAI completion stream (chat or text completion).

One reader for every place that reads an agent's streamed completions: the certification's
soak (`certify/soak.py`), the benchmarks, net-sim's load driver and the tests. It imports only
the standard library and `meshagent.errors` (which imports nothing), so that the load driver,
which stays that light beside the agents it measures, can use it too.

An event is given when the blank line that ends it arrives; an event the stream never ends (a
cut connection) is never given. Comments (`: ...` lines, keep-alives) are skipped.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from meshagent.errors import MeshError

DONE = "[DONE]"  # the data of an OpenAI stream's last event
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Event:
    data: str  # its `data:` lines, joined by newlines
    event: str = "message"  # its `event:` line, if any
    id: str | None = None  # the last `id:` the stream gave, if any

    @property
    def done(self) -> bool:
        """Whether this is the `data: [DONE]` that ends an OpenAI stream."""
        return self.data == DONE

    def json(self) -> Any:
        return json.loads(self.data)


class EventDecoder:
    """Feed it the stream's lines (`line`) or its bytes as they come (`feed`); it returns each
    event as its last line arrives."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._rest = ""  # a line not ended yet

    def line(self, line: str) -> Event | None:
        """One line, without its line ending; the event it ends, if it ends one."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that `chunk`, the next bytes of the stream, ends."""
        text = self._rest + self._text.decode(chunk)
        events = []
        start = 0
        for end in _LINE_END.finditer(text):
            if end.group() == "\r" and end.end() == len(text):
                break  # maybe the first half of "\r\n"
            event = self.line(text[start : end.start()])
            if event is not None:
                events.append(event)
            start = end.end()
        self._rest = text[start:]
        return events

    def _dispatch(self) -> Event | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return Event("\n".join(data), event or "message", self._id)


class _Lines(Protocol):
    def iter_lines(self) -> Iterator[str]: ...


class _AsyncLines(Protocol):
    def aiter_lines(self) -> AsyncIterator[str]: ...


def iter_events(response: _Lines) -> Iterator[Event]:
    """The events of a streaming response (`httpx.stream(...)`), as they arrive."""
    decoder = EventDecoder()
    for line in response.iter_lines():
        event = decoder.line(line)
        if event is not None:
            yield event


async def aiter_events(response: _AsyncLines) -> AsyncIterator[Event]:
    """The events of an async streaming response (`httpx.AsyncClient.stream(...)`)."""
    decoder = EventDecoder()
    async for line in response.aiter_lines():
        event = decoder.line(line)
        if event is not None:
            yield event


class StreamIncomplete(MeshError):
    """A completion stream that ended in an error event, or without `[DONE]`."""


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completion stream's chunk adds: a chat chunk's delta content, a text
    completion chunk's text; "" where it adds none (a role, the usage)."""
    choices = chunk.get("choices")
    if not choices:
        return ""
    delta = choices[0].get("delta")
    return (delta.get("content") if delta is not None else choices[0].get("text")) or ""


def completion_text(events: Iterable[Event]) -> str:
    """The text of a whole completion stream; StreamIncomplete if it ends in an error event
    or without `[DONE]`."""
    parts, done = [], False
    for event in events:
        if event.done:
            done = True
            continue
        chunk = event.json()
        if "error" in chunk:
            raise StreamIncomplete(f"an error event: {chunk['error']}")
        parts.append(chunk_text(chunk))
    if not done:
        raise StreamIncomplete("the stream ended without [DONE]")
    return "".join(parts)
