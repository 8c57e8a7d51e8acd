"""A completion served by this agent's own model: its events for the protocol module (`Opened`
first; each of n choices' tagged, the prompt prefilled once), and a generation that the mesh
moves away from this agent mid-request handed on (`Moved`) to the entry that serves the model
now, from the tokens and characters sent so far."""

from __future__ import annotations

import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import trio

from meshagent.api.completion_events import Choice, Events, Failed, Opened
from meshagent.api.errors import api_error_for
from meshagent.api.prepare import Prepared
from meshagent.errors import MeshError, ModelMoved
from meshagent.serving.directory import Headers
from meshagent.serving.generation import Delta, Finished, GenerationRequest
from meshagent.serving.local_model import LocalModel


@dataclass(frozen=True)
class Continuation:
    """A generation begun on one agent, to go on at another: the tokens generated, the
    characters of their text the client has, the prompt's length, the seed it samples with
    and why it moves."""

    history: tuple[int, ...]
    delivered: int
    prompt_tokens: int
    seed: int | None
    why: str


def opened(p: Prepared, receipt: Headers) -> Opened:
    """The shape of `p`'s reply, served here with `receipt`."""
    tools = None if p.tools is None else p.tools.syntax
    logprobs = p.gen.sampling.logprobs is not None
    return Opened(
        p.chat, p.model.info.id, p.n, p.stream, p.include_usage, logprobs, p.echo, tools, receipt
    )


# Goes on elsewhere with a generation the mesh moved away (`api/elsewhere.py`); its events,
# or its failure, to the channel given.
Moved = Callable[[Continuation, Events], Awaitable[None]]


async def serve(
    p: Prepared, gen: GenerationRequest, opened: Opened, out: Events, moved: Moved
) -> None:
    """`p` generated here (`gen`: its request, seeded), its events to `out`: `opened`, then
    Delta and Finished (each choice's as a `Choice` when n > 1), or `Failed`."""
    out.send_nowait(opened)
    if p.n > 1:
        await _choices(p, gen, out)
        return
    tokens, chars, error = await generate_counted(p.model, gen, out)
    if isinstance(error, ModelMoved):
        sent = Continuation(
            tuple(tokens), chars, len(gen.prompt_tokens), gen.sampling.seed, str(error)
        )
        await moved(sent, out)
    elif error is not None:
        out.send_nowait(Failed(api_error_for(error, prompt_param=p.prompt_param)))


async def _choices(p: Prepared, gen: GenerationRequest, out: Events) -> None:
    """The n completions of `p`: one request each, sharing one prefill of the prompt, choice i
    sampling with the seed + i. (A model that moves mid-request fails it: n completions are
    not handed on.)"""
    share = secrets.token_hex(8)
    seed = gen.sampling.seed

    async def choice(i: int, out: Events) -> None:
        sampling = replace(gen.sampling, seed=None if seed is None else seed + i)
        own = replace(gen, sampling=sampling, share=share)
        failed: list[MeshError] = []
        async with out:
            async with trio.open_nursery() as nursery:
                async for ev in generating(nursery, p.model, own, failed):
                    out.send_nowait(Choice(i, ev))
            if failed:
                out.send_nowait(Failed(api_error_for(failed[0], prompt_param=p.prompt_param)))

    async with trio.open_nursery() as nursery:
        for i in range(p.n):
            nursery.start_soon(choice, i, out.clone())


async def generate_counted(
    model: LocalModel, gen: GenerationRequest, out: Events
) -> tuple[list[int], int, MeshError | None]:
    """`model` generating `gen` into `out`: the tokens and the characters sent, and the error
    it ended with, if any (what a request needs to be handed on)."""
    failed: list[MeshError] = []
    tokens: list[int] = []
    chars = 0
    async with trio.open_nursery() as nursery:
        async for ev in generating(nursery, model, gen, failed):
            if isinstance(ev, Delta):
                tokens += ev.tokens
                chars += len(ev.text)
            out.send_nowait(ev)
    return tokens, chars, failed[0] if failed else None


def generating(
    nursery: trio.Nursery, model: LocalModel, gen: GenerationRequest, failed: list[MeshError]
) -> trio.MemoryReceiveChannel[Delta | Finished]:
    """`model` generating `gen` in `nursery`: its events, and its error put in `failed`."""
    send, events = trio.open_memory_channel[Delta | Finished](math.inf)

    async def produce() -> None:
        async with send:
            try:
                await model.generate(gen, send)
            except MeshError as e:
                failed.append(e)

    nursery.start_soon(produce)
    return events
