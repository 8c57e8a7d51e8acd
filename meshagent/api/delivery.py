"""A completion's events (text, its end, or a failure) to the client: as server-sent events,
or as one JSON reply at the end; the request's meter hears of each."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from meshagent.api.errors import ApiError
from meshagent.api.exchange import Exchange
from meshagent.api.metrics import RequestMeter
from meshagent.api.replies import Reply
from meshagent.serving.generation import Delta, Finished


@dataclass(frozen=True)
class Failed:
    error: ApiError


async def stream_reply(
    ex: Exchange,
    events: trio.MemoryReceiveChannel[Delta | Finished | Failed],
    reply: Reply,
    include_usage: bool,
    echo: str,
    receipt: list[tuple[bytes, bytes]],
    meter: RequestMeter,
) -> None:
    async for ev in events:
        if isinstance(ev, Failed):
            meter.fail(ev.error.status, ev.error.message)
            if not ex.started:
                await ex.send_error(ev.error)
            else:
                await ex.send_event(ev.error.body())
                await ex.end()
            return
        if not ex.started:
            await ex.start_sse(receipt)
            opening = reply.opening()
            if opening is not None:
                await ex.send_event(opening)
            if echo:
                await ex.send_event(reply.chunk(echo))
        if isinstance(ev, Delta):
            meter.first_text()
            for chunk in reply.delta_chunks(ev):
                await ex.send_event(chunk)
        else:
            meter.finished(ev)
            for chunk in reply.end_chunks(ev.reason):
                await ex.send_event(chunk)
            if include_usage:
                await ex.send_event(reply.usage_chunk(ev))
            await ex.send_event("[DONE]")
            await ex.end()
            return


async def whole_reply(
    ex: Exchange,
    events: trio.MemoryReceiveChannel[Delta | Finished | Failed],
    reply: Reply,
    echo: str,
    receipt: list[tuple[bytes, bytes]],
    meter: RequestMeter,
) -> None:
    deltas: list[Delta] = []
    async for ev in events:
        if isinstance(ev, Failed):
            meter.fail(ev.error.status, ev.error.message)
            await ex.send_error(ev.error)
            return
        if isinstance(ev, Delta):
            meter.first_text()
            deltas.append(ev)
        else:
            meter.finished(ev)
            await ex.send_json(200, reply.whole(echo, deltas, ev), receipt)
            return
