"""The n completions of one request (`n` > 1): n generations of one prompt, prefilled once,
their events tagged with the choice they belong to."""

from __future__ import annotations

import math
import secrets
from dataclasses import replace

import trio

from meshagent.api.delivery import Choice, Event, Failed
from meshagent.api.errors import api_error_for
from meshagent.api.prepare import Prepared
from meshagent.errors import MeshError
from meshagent.serving.generation import Delta, Finished, GenerationRequest


async def produce_choices(
    p: Prepared, gen: GenerationRequest, send: trio.MemorySendChannel[Event]
) -> None:
    """Generate the n completions of `p` into `send`, each event as a `Choice`: one request
    each, sharing one prefill of the prompt, choice i sampling with the seed + i. (A model
    that moves mid-request fails it: n completions are not handed on.)"""
    share = secrets.token_hex(8)
    seed = gen.sampling.seed

    async def choice(i: int, out: trio.MemorySendChannel[Event]) -> None:
        sampling = replace(gen.sampling, seed=None if seed is None else seed + i)
        own = replace(gen, sampling=sampling, share=share)
        into, events = trio.open_memory_channel[Delta | Finished](math.inf)
        failed: list[MeshError] = []

        async def run() -> None:
            async with into:
                try:
                    await p.model.generate(own, into)
                except MeshError as e:
                    failed.append(e)

        async with out:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                async for ev in events:
                    out.send_nowait(Choice(i, ev))
            if failed:
                out.send_nowait(Failed(api_error_for(failed[0], prompt_param=p.prompt_param)))

    async with send, trio.open_nursery() as nursery:
        for i in range(p.n):
            nursery.start_soon(choice, i, send.clone())
