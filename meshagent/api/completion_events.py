"""What a completion produces, whoever serves it, for the protocol module that answers the client
(`openai_routes.py`, `responses.py`, `ollama.py`): `Opened` (the reply's shape), then the
generation's `Delta`s and `Finished` (each of n choices' as a `Choice`), or `Failed`.

A protocol module reads them through `Completion`, which tells the request's meter of each as
it passes (`api/metrics.py`), so no protocol counts anything itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange
from meshagent.api.metrics import RequestMeter
from meshagent.api.replies import merged
from meshagent.api.tools import Syntax
from meshagent.serving.directory import Headers
from meshagent.serving.generation import Delta, Finished


@dataclass(frozen=True)
class Opened:
    """The reply's shape, known once an agent has taken the request: the model that serves it
    and how it was asked."""

    chat: bool
    model: str
    n: int  # choices
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: str  # text completions with echo: the prompt, sent before the completion
    tools: Syntax | None  # the syntax the model writes tool calls in, if it may call any
    receipt: Headers  # who serves it (docs/api.md, "Receipts")


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass(frozen=True)
class Choice:
    """An event of the completion with this index (of n)."""

    index: int
    event: Delta | Finished


Event = Opened | Delta | Finished | Choice | Failed
Events = trio.MemorySendChannel[Event]


def unwrap(ev: Delta | Finished | Choice) -> tuple[int, Delta | Finished]:
    """The choice an event belongs to (0 of a request for one), and the event."""
    return (ev.index, ev.event) if isinstance(ev, Choice) else (0, ev)


class Completion:
    """The events of one completion as its protocol module reads them: `opened()` first, then
    each event (`async for`); the meter hears of each."""

    def __init__(self, events: trio.MemoryReceiveChannel[Event], meter: RequestMeter) -> None:
        self._events = events
        self._meter = meter
        self._n = 1
        self._dones: dict[int, Finished] = {}

    async def opened(self) -> Opened | Failed:
        """The reply's shape, or why the request failed before any agent took it."""
        try:
            ev = await self._events.receive()
        except trio.EndOfChannel:  # the producer ends with one or the other
            raise AssertionError("a completion ended before it was opened") from None
        if isinstance(ev, Opened):
            self._n = ev.n
            self._meter.receipt(ev.receipt)
            return ev
        if isinstance(ev, Failed):
            self._failed(ev)
            return ev
        raise AssertionError(f"a completion began with {type(ev).__name__}")

    def __aiter__(self) -> Completion:
        return self

    async def __anext__(self) -> Delta | Finished | Choice | Failed:
        try:
            ev = await self._events.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(ev, Opened):
            raise AssertionError("a completion was opened twice")
        if isinstance(ev, Failed):
            self._failed(ev)
            return ev
        index, inner = unwrap(ev)
        if isinstance(inner, Delta):
            self._meter.first_text()
        else:
            self._dones[index] = inner
            if len(self._dones) == self._n:
                self._meter.finished(merged([self._dones[i] for i in range(self._n)]))
        return ev

    def _failed(self, ev: Failed) -> None:
        self._meter.fail(ev.error.status, ev.error.message)


# How a protocol module answers the client of one completion from its events.
Deliver = Callable[[Exchange, Completion], Awaitable[None]]
