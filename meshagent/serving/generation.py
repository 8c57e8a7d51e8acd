"""One request's generation: prompt in, text deltas and a finish event out."""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import trio

from meshagent.errors import ContextOverflow, SplitUnavailable
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams
from meshagent.serving.stops import StopMatcher

log = structlog.get_logger(__name__)


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
    replays: tuple[Replay, ...] = ()  # lost stages this request survived


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


@dataclass(frozen=True)
class Replay:
    """A request continued on a new chain after it lost a stage."""

    reason: str  # why the chain broke
    tokens: int  # prompt and generated tokens prefilled again
    ms: float  # from the break to the first token of the new chain
    wait_ms: float = 0.0  # of which waiting for a chain that serves (the rest: the replay)


@dataclass(frozen=True)
class Route:
    """What serves a model here now: its runner, and the token text of that runner's model
    (a new plan brings a new engine; the old one's vocabulary may be freed already)."""

    runner: ModelRunner
    token_bytes: Callable[[int], bytes]


# Returns what serves the model now (after a lost stage: the same pipeline, or the entry of a
# new plan), waiting while there is none.
Reroute = Callable[[], Awaitable[Route]]

_RETRY_FIRST, _RETRY_MAX = 0.25, 2.0  # seconds between tries of a chain that is not back yet


def _gave_up(error: SplitUnavailable, deadline: float) -> SplitUnavailable:
    return SplitUnavailable(f"{error} (no chain served this model again within {deadline:g} s)")


async def generate(
    runner: ModelRunner,
    token_bytes: Callable[[int], bytes],
    request: GenerationRequest,
    out: trio.MemorySendChannel[Delta | Finished],
    *,
    reroute: Reroute | None = None,
    replay_deadline: float = 30.0,
) -> None:
    """Generate into `out` (never blocks on it: give it room for max_tokens + 1 events).

    The runner computes and samples on its own thread; here tokens only become text, and stop
    strings are matched. The slot is held only while tokens are computed, not while a slow
    client reads.

    With `reroute`, a request whose split loses a stage (SplitUnavailable) is replayed: the
    prompt and the tokens generated so far run again on the chain `reroute` gives, in the
    batches they first ran in (`Scheduler.submit`), with the same seed, and generation
    continues from the next token, so `out` sees one unbroken text. Past `replay_deadline`
    seconds without a chain that serves, the error is raised.
    """
    limit = check_fits(request, runner.slot_ctx)
    sampling = request.sampling.seeded()  # a replay must draw what the first chain would have
    stops = StopMatcher(request.stop)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    history: list[int] = []  # the tokens generated so far
    reason = "length"
    stage_ms: list[float] = []
    replays: list[Replay] = []
    broke: tuple[str, float] | None = None  # the break being replayed: why, and when
    tries = 0  # chains tried since that break
    while True:
        try:
            async with runner.start(
                request.prompt_tokens, limit - len(history), sampling, tuple(history)
            ) as handle:
                submitted = trio.current_time()
                while True:
                    ev = await handle.next()
                    if broke is not None:
                        why, since = broke
                        ms = round((trio.current_time() - since) * 1000, 1)
                        wait_ms = round((submitted - since) * 1000, 1)
                        tokens = len(request.prompt_tokens) + len(history)
                        replays.append(Replay(why, tokens, ms, wait_ms))
                        broke = None
                    if len(stage_ms) < len(ev.timing):
                        stage_ms += [0.0] * (len(ev.timing) - len(stage_ms))
                    for i, ms in enumerate(ev.timing):
                        stage_ms[i] += ms
                    if ev.finish == "stop":
                        reason = "stop"
                        break
                    history.append(ev.token)
                    text = stops.feed(utf8.decode(token_bytes(ev.token)))
                    if text:
                        out.send_nowait(Delta(text))
                    if stops.stopped:
                        reason = "stop"
                        break
                    if ev.finish is not None:
                        break
            break
        except SplitUnavailable as e:
            if reroute is None:
                raise
            if broke is None:
                broke = (str(e), trio.current_time())
                tries = 0
            waited = trio.current_time() - broke[1]
            if waited >= replay_deadline:
                raise _gave_up(e, replay_deadline) from e
            if tries:  # the chain was not back on the last try: wait a little longer each time
                await trio.sleep(min(_RETRY_FIRST * 2 ** (tries - 1), _RETRY_MAX))
            tries += 1
            log.info("generation.replay", reason=str(e), tokens=len(history), tries=tries)
            with trio.move_on_after(replay_deadline - waited) as wait:
                route = await reroute()
            if wait.cancelled_caught:
                raise _gave_up(e, replay_deadline) from e
            runner, token_bytes = route.runner, route.token_bytes
    tail = stops.feed(utf8.decode(b"", final=True)) + stops.flush()
    if tail:
        out.send_nowait(Delta(tail))
    ms = tuple(round(t, 3) for t in stage_ms)
    finished = Finished(reason, len(request.prompt_tokens), len(history), ms, tuple(replays))
    out.send_nowait(finished)
