"""A completion's events (text, its end, or a failure) to the client: as server-sent events,
or as one JSON reply at the end; the request's meter hears of each. A request for n
completions sends each choice's events as a `Choice`; the reply ends when all n have."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange
from meshagent.api.metrics import RequestMeter
from meshagent.api.replies import Reply, merged
from meshagent.serving.generation import Delta, Finished


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass(frozen=True)
class Choice:
    """An event of the completion with this index (of n)."""

    index: int
    event: Delta | Finished


Event = Delta | Finished | Failed | Choice


def _unwrap(ev: Delta | Finished | Choice) -> tuple[int, Delta | Finished]:
    return (ev.index, ev.event) if isinstance(ev, Choice) else (0, ev)


async def stream_reply(
    ex: Exchange,
    events: trio.MemoryReceiveChannel[Event],
    reply: Reply,
    include_usage: bool,
    echo: str,
    receipt: list[tuple[bytes, bytes]],
    meter: RequestMeter,
) -> None:
    dones: dict[int, Finished] = {}
    async for item in events:
        if isinstance(item, Failed):
            meter.fail(item.error.status, item.error.message)
            if not ex.started:
                await ex.send_error(item.error)
            else:
                await ex.send_event(item.error.body())
                await ex.end()
            return
        if not ex.started:
            await ex.start_sse(receipt)
            for opening in reply.opening():
                await ex.send_event(opening)
            if echo:
                for i in range(reply.n):
                    await ex.send_event(reply.chunk(echo, index=i))
        index, ev = _unwrap(item)
        if isinstance(ev, Delta):
            meter.first_text()
            for chunk in reply.delta_chunks(ev, index):
                await ex.send_event(chunk)
            continue
        dones[index] = ev
        for chunk in reply.end_chunks(ev.reason, index):
            await ex.send_event(chunk)
        if len(dones) == reply.n:
            done = merged([dones[i] for i in range(reply.n)])
            meter.finished(done)
            if include_usage:
                await ex.send_event(reply.usage_chunk(done))
            await ex.send_event("[DONE]")
            await ex.end()
            return


async def whole_reply(
    ex: Exchange,
    events: trio.MemoryReceiveChannel[Event],
    reply: Reply,
    echo: str,
    receipt: list[tuple[bytes, bytes]],
    meter: RequestMeter,
) -> None:
    deltas: list[list[Delta]] = [[] for _ in range(reply.n)]
    dones: dict[int, Finished] = {}
    async for item in events:
        if isinstance(item, Failed):
            meter.fail(item.error.status, item.error.message)
            await ex.send_error(item.error)
            return
        index, ev = _unwrap(item)
        if isinstance(ev, Delta):
            meter.first_text()
            deltas[index].append(ev)
            continue
        dones[index] = ev
        if len(dones) == reply.n:
            ends = [dones[i] for i in range(reply.n)]
            meter.finished(merged(ends))
            await ex.send_json(200, reply.whole(echo, deltas, ends), receipt)
            return
