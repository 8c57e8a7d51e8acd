"""One request's generation: prompt in, text deltas and a finish event out."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog
import trio

from meshagent.engine.base import TokenModel, check_tokens
from meshagent.errors import ContextOverflow, OutOfRange, SplitUnavailable
from meshagent.serving.runner import ModelRunner
from meshagent.serving.sampling import SamplingParams, TokenLogprob
from meshagent.serving.stops import StopMatcher

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int | None  # None: up to the end of the slot's context
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    # A continuation (the request's entry was lost): the tokens generated before, and how many
    # characters of their text the client already has; only what follows is emitted.
    history: tuple[int, ...] = ()
    delivered: int = 0
    # Drafts from the sequence's own text (`serving/drafting.py`): "auto", "on" or "off";
    # None: what the model serving it is set to.
    speculation: str | None = None
    # Requests with one key (the n completions of one request) prefill their prompt once.
    share: str | None = None


@dataclass(frozen=True)
class Logprob:
    """A generated token's bytes and log-probability, and the most likely tokens at its
    step with theirs (`TokenLogprob`, with each token's bytes)."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: tuple[int, ...] = ()  # the tokens generated since the previous delta
    # Where the request asked for them: one per token of `tokens`, in order.
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    stage_ms: tuple[float, ...] = ()  # a split's time per stage on this request
    replays: tuple[Replay, ...] = ()  # lost stages this request survived
    speculation: Speculation | None = None  # what drafting did, when drafts were verified
    cached_tokens: int = 0  # prompt tokens a kept prefix gave it (not prefilled)
    stop: str | None = None  # the stop string that ended it, if one did


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


def check_history(request: GenerationRequest, model: TokenModel, limit: int) -> None:
    """Raise OutOfRange unless a continuation (another agent's word for what was generated)
    could have been generated for `request` on `model`: at most `limit` tokens (`check_fits`),
    each of the vocabulary, and no more characters delivered than their text holds."""
    history = request.history
    if len(history) > limit:
        raise OutOfRange(
            f"a continuation of {len(history)} tokens, more than the request may generate "
            f"here ({limit})"
        )
    check_tokens(history, model.info.n_vocab)
    # Each character of the text took at least one byte of it.
    if request.delivered > sum(len(model.token_bytes(t)) for t in history):
        raise OutOfRange(
            f"{request.delivered} characters delivered: more characters than the text of "
            f"the continuation's {len(history)} tokens holds"
        )


@dataclass
class Speculation:
    """Drafts of one request: windows verified, draft tokens sent, how many were right, and
    the most windows it had in flight at once (a split's entry sends the next window before
    the verdict on the last)."""

    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    peak_in_flight: int = 0
    # Of those, the windows whose draft was the draft model's, their draft tokens and the
    # right ones (the rest came from the request's own text).
    model_windows: int = 0
    model_drafted: int = 0
    model_accepted: int = 0
    draft_model: str | None = None  # the draft model the request could draft with


@dataclass(frozen=True)
class Replay:
    """A request continued on a new chain after it lost a stage."""

    reason: str  # why the chain broke
    tokens: int  # prompt and generated tokens prefilled again
    ms: float  # from the break to the first token of the new chain
    wait_ms: float = 0.0  # of which waiting for a chain that serves (the rest: the replay)
    lost: tuple[str, ...] = ()  # the stages found lost, as `<peer id>:<first layer>-<end>`


class _Text:
    """Token ids to the text a client gets: UTF-8 decoded across token boundaries, stop
    strings held back and cut; each delta carries the tokens since the previous one."""

    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...]) -> None:
        self.token_bytes = token_bytes
        self.stops = StopMatcher(stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tokens: list[int] = []
        self._logprobs: list[Logprob] = []

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def feed(self, token: int, logprob: TokenLogprob | None = None) -> Delta | None:
        self._tokens.append(token)
        if logprob is not None:
            top = tuple((self.token_bytes(t), lp) for t, lp in logprob.top)
            self._logprobs.append(Logprob(self.token_bytes(token), logprob.logprob, top))
        text = self.stops.feed(self._utf8.decode(self.token_bytes(token)))
        if not text:
            return None
        delta = Delta(text, tuple(self._tokens), tuple(self._logprobs))
        self._tokens.clear()
        self._logprobs.clear()
        return delta

    def resume(self, history: tuple[int, ...], delivered: int) -> Delta | None:
        """Feed the tokens of a continuation: their text, less the `delivered` characters
        the client has, is what is still owed (nothing, when the break fell between deltas)."""
        text = "".join(d.text for t in history if (d := self.feed(t)) is not None)
        self._tokens.clear()
        self._logprobs.clear()
        owed = text[delivered:]
        return Delta(owed) if owed else None

    def tail(self) -> Delta | None:
        text = self.stops.feed(self._utf8.decode(b"", final=True)) + self.stops.flush()
        return Delta(text, tuple(self._tokens), tuple(self._logprobs)) if text else None


class Recoverer(Protocol):
    """A request's recovery from a lost chain (`serving/recovery.py`)."""

    replays: list[Replay]

    async def after(self, error: SplitUnavailable, tokens: int) -> Rerouted: ...

    def served(self, tokens: int) -> None: ...


class Rerouted(Protocol):
    runner: ModelRunner
    token_bytes: Callable[[int], bytes]


async def generate(
    runner: ModelRunner,
    token_bytes: Callable[[int], bytes],
    request: GenerationRequest,
    out: trio.MemorySendChannel[Delta | Finished],
    *,
    recovery: Recoverer | None = None,
) -> None:
    """Generate into `out` (never blocks on it: give it room for max_tokens + 1 events).

    The runner computes and samples on its own thread; here tokens only become text, and stop
    strings are matched. The slot is held only while tokens are computed, not while a slow
    client reads.

    With a `recovery`, a request whose split loses a stage (SplitUnavailable) is replayed:
    the prompt and the tokens generated so far run again on the chain it finds, in the
    batches they first ran in (`Scheduler.submit`), with the same seed, and generation
    continues from the next token, so `out` sees one unbroken text. Past its deadline without
    a chain that serves, the error is raised.

    A request with a `history` continues one that another entry began: those tokens are
    prefilled after the prompt, and only text the client does not have yet is emitted.
    """
    limit = check_fits(request, runner.slot_ctx)
    sampling = request.sampling.seeded()  # a replay must draw what the first chain would have
    text = _Text(token_bytes, request.stop)
    history = list(request.history)  # the tokens generated so far
    if (owed := text.resume(request.history, request.delivered)) is not None:
        out.send_nowait(owed)
    reason = "stop" if text.stopped else "length"
    stage_ms: list[float] = []
    mode = request.speculation or "off"
    spec = Speculation() if mode != "off" and runner.executor.speculates else None
    if spec is not None and (draft := runner.scheduler.drafting.model) is not None:
        spec.draft_model = draft.name
    cached = 0
    while not text.stopped and len(history) < limit:
        try:
            async with runner.start(
                request.prompt_tokens,
                limit - len(history),
                sampling,
                tuple(history),
                speculation=mode,
                share=request.share if not history else None,
            ) as handle:
                while True:
                    ev = await handle.next()
                    if recovery is not None:
                        recovery.served(len(request.prompt_tokens) + len(history))
                    if ev.cached:  # the first token of a sequence that started from a prefix
                        cached = min(ev.cached, len(request.prompt_tokens))
                    if len(stage_ms) < len(ev.timing):
                        stage_ms += [0.0] * (len(ev.timing) - len(stage_ms))
                    for i, ms in enumerate(ev.timing):
                        stage_ms[i] += ms
                    if spec is not None and ev.drafted:
                        spec.windows += 1
                        spec.drafted += ev.drafted
                        spec.accepted += ev.accepted
                        spec.peak_in_flight = max(spec.peak_in_flight, ev.windows)
                        if ev.model:
                            spec.model_windows += 1
                            spec.model_drafted += ev.drafted
                            spec.model_accepted += ev.accepted
                    if ev.finish == "stop":
                        reason = "stop"
                        break
                    history.append(ev.token)
                    if (delta := text.feed(ev.token, ev.logprob)) is not None:
                        out.send_nowait(delta)
                    if text.stopped:
                        reason = "stop"
                        break
                    if ev.finish is not None:
                        break
            break
        except SplitUnavailable as e:
            if recovery is None:
                raise
            route = await recovery.after(e, len(request.prompt_tokens) + len(history))
            runner, text.token_bytes = route.runner, route.token_bytes
    if (tail := text.tail()) is not None:
        out.send_nowait(tail)
    ms = tuple(round(t, 3) for t in stage_ms)
    # Drafts verified, if any (or a draft model the request could have drafted with).
    spec = spec if spec is not None and (spec.windows or spec.draft_model) else None
    replays = tuple(recovery.replays) if recovery is not None else ()
    finished = Finished(
        reason,
        len(request.prompt_tokens),
        len(history),
        ms,
        replays,
        spec,
        cached,
        text.stops.matched,
    )
    out.send_nowait(finished)
