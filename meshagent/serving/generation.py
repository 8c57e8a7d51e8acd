"""One request's generation: prompt in, text deltas and a finish event out."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass

import trio

from meshagent.errors import ContextOverflow
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.stops import StopMatcher


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int | None  # None: up to the end of the slot's context
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    stage_ms: tuple[float, ...] = ()  # a split's time per stage on this request


def check_fits(request: GenerationRequest, slot_ctx: int) -> int:
    """The number of tokens the request may generate; ContextOverflow if it cannot fit."""
    n_prompt = len(request.prompt_tokens)
    room = slot_ctx - n_prompt
    if room < 1:
        raise ContextOverflow(
            f"This model's maximum context length is {slot_ctx} tokens. However, your "
            f"prompt is {n_prompt} tokens long. Shorten the prompt.",
            prompt_tokens=n_prompt,
            limit=slot_ctx,
        )
    if request.max_tokens is None:
        return room
    if request.max_tokens > room:
        raise ContextOverflow(
            f"This model's maximum context length is {slot_ctx} tokens. However, you "
            f"requested {n_prompt + request.max_tokens} tokens ({n_prompt} in the prompt, "
            f"{request.max_tokens} for the completion). Reduce the prompt or max_tokens.",
            prompt_tokens=n_prompt,
            limit=slot_ctx,
        )
    return request.max_tokens


async def generate(
    runner: ModelRunner,
    token_bytes: Callable[[int], bytes],
    request: GenerationRequest,
    out: trio.MemorySendChannel[Delta | Finished],
) -> None:
    """Generate into `out` (never blocks on it: give it room for max_tokens + 1 events).

    The runner computes and samples on its own thread; here tokens only become text, and stop
    strings are matched. The slot is held only while tokens are computed, not while a slow
    client reads.
    """
    limit = check_fits(request, runner.slot_ctx)
    stops = StopMatcher(request.stop)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    produced = 0
    reason = "length"
    stage_ms: list[float] = []
    async with runner.start(request.prompt_tokens, limit, request.sampling) as handle:
        while True:
            ev = await handle.next()
            if len(stage_ms) < len(ev.timing):
                stage_ms += [0.0] * (len(ev.timing) - len(stage_ms))
            for i, ms in enumerate(ev.timing):
                stage_ms[i] += ms
            if ev.finish == "stop":
                reason = "stop"
                break
            produced += 1
            text = stops.feed(utf8.decode(token_bytes(ev.token)))
            if text:
                out.send_nowait(Delta(text))
            if stops.stopped:
                reason = "stop"
                break
            if ev.finish is not None:
                break
    tail = stops.feed(utf8.decode(b"", final=True)) + stops.flush()
    if tail:
        out.send_nowait(Delta(tail))
    ms = tuple(round(t, 3) for t in stage_ms)
    out.send_nowait(Finished(reason, len(request.prompt_tokens), produced, ms))
