"""A completion's events as OpenAI's reply (`openai_routes.py`): server-sent events, or one JSON
body at the end. A request for n completions ends when all n have."""

from __future__ import annotations

from meshagent.api.completion_events import Completion, Failed, Opened, unwrap
from meshagent.api.exchange import Exchange
from meshagent.api.replies import Reply, merged
from meshagent.serving.generation import Delta, Finished


async def deliver(ex: Exchange, completion: Completion) -> None:
    """Answer `ex` with `completion`, streamed or whole as its request asked."""
    opened = await completion.opened()
    if isinstance(opened, Failed):
        await ex.send_error(opened.error)
        return
    reply = Reply(opened.chat, opened.model, opened.logprobs, opened.tools, opened.n)
    if opened.stream:
        await _stream(ex, completion, opened, reply)
    else:
        await _whole(ex, completion, opened, reply)


async def _stream(ex: Exchange, completion: Completion, opened: Opened, reply: Reply) -> None:
    dones: dict[int, Finished] = {}
    begun = False
    async for item in completion:
        if isinstance(item, Failed):
            if not ex.started:
                await ex.send_error(item.error)
            else:
                await ex.send_event(item.error.body())
                await ex.end()
            return
        if not begun:
            begun = True
            if not ex.started:  # (a stream that waited for its model to load began already)
                await ex.start_sse(opened.receipt)
            for opening in reply.opening():
                await ex.send_event(opening)
            if opened.echo:
                for i in range(reply.n):
                    await ex.send_event(reply.chunk(opened.echo, index=i))
        index, ev = unwrap(item)
        if isinstance(ev, Delta):
            for chunk in reply.delta_chunks(ev, index):
                await ex.send_event(chunk)
            continue
        dones[index] = ev
        for chunk in reply.end_chunks(ev.reason, index):
            await ex.send_event(chunk)
        if len(dones) == reply.n:
            if opened.include_usage:
                await ex.send_event(reply.usage_chunk(merged([dones[i] for i in range(reply.n)])))
            await ex.send_event("[DONE]")
            await ex.end()
            return


async def _whole(ex: Exchange, completion: Completion, opened: Opened, reply: Reply) -> None:
    deltas: list[list[Delta]] = [[] for _ in range(reply.n)]
    dones: dict[int, Finished] = {}
    async for item in completion:
        if isinstance(item, Failed):
            await ex.send_error(item.error)
            return
        index, ev = unwrap(item)
        if isinstance(ev, Delta):
            deltas[index].append(ev)
            continue
        dones[index] = ev
        if len(dones) == reply.n:
            ends = [dones[i] for i in range(reply.n)]
            await ex.send_json(200, reply.whole(opened.echo, deltas, ends), opened.receipt)
            return
