"""The JSON shapes of chat and text completions, whole and streamed."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from meshagent.api.tools import ArgsDelta, Call, CallParser, CallStart, Part, Syntax, Text
from meshagent.serving.generation import Delta, Finished, Logprob


def usage(done: Finished) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        # OpenAI's field: prompt tokens that a kept prefix gave (not prefilled again).
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }
    receipt: dict[str, Any] = {}
    if done.stage_ms:
        # The receipt of a split: milliseconds each stage (in pipeline order, the peers of
        # the x-meshagent-stages header) spent computing for this request.
        receipt["stage_ms"] = list(done.stage_ms)
    if done.replays:
        # Lost stages the request survived: why the chain broke, the stages found lost
        # (`<peer id>:<first layer>-<end>`), the tokens prefilled again on the new chain, the
        # milliseconds from the break to its next token, and of those the wait for a chain
        # that serves (the rest is the replay itself).
        receipt["replays"] = [
            {
                "reason": r.reason,
                "lost": list(r.lost),
                "tokens": r.tokens,
                "ms": r.ms,
                "wait_ms": r.wait_ms,
            }
            for r in done.replays
        ]
    if done.speculation is not None:
        # Drafts from the request's own text or a draft model: windows verified, draft tokens
        # sent, how many of them were right (each one a step saved), and the most windows in
        # flight at once.
        s = done.speculation
        receipt["speculation"] = {
            "windows": s.windows,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "peak_windows_in_flight": s.peak_in_flight,
        }
        if s.draft_model is not None:
            # A draft model beside the text's drafts: its name, and of the windows above
            # those it drafted, their draft tokens and the right ones.
            receipt["speculation"]["draft_model"] = {
                "name": s.draft_model,
                "windows": s.model_windows,
                "drafted": s.model_drafted,
                "accepted": s.model_accepted,
            }
    if receipt:
        out["meshagent"] = receipt
    return out


def _token_text(token: bytes) -> str:
    return token.decode(errors="replace")


def chat_logprobs(lps: tuple[Logprob, ...]) -> dict[str, Any]:
    """A chat choice's `logprobs`: each token, its bytes and log-probability, and the most
    likely tokens at its step."""

    def entry(token: bytes, logprob: float) -> dict[str, Any]:
        return {"token": _token_text(token), "logprob": logprob, "bytes": list(token)}

    content = [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]
    return {"content": content, "refusal": None}


class Output:
    """One choice's text as its client gets it while it streams: with the syntax the model
    writes tool calls in, the calls parsed out of the text (and the blank text between them
    dropped), and the finish reason `tool_calls` when it made any. Every protocol's reply
    reads a choice through one (`Reply`, `responses.py`, `ollama.py`)."""

    def __init__(self, tools: Syntax | None, *, partial: bool = False) -> None:
        """`partial`: calls also come as they are written (`CallParser`)."""
        self.parser = None if tools is None else CallParser(tools, partial=partial)
        self.done: Finished | None = None  # its end, once it came
        self.finish: str | None = None  # ...and the finish reason

    def parts(self, ev: Delta | Finished) -> list[Part]:
        """What an event of the choice adds: its text's parts, or (its end) those held."""
        if isinstance(ev, Delta):
            return self.feed(ev.text)
        parts, self.finish = self.end(ev.reason)
        self.done = ev
        return parts

    def feed(self, text: str) -> list[Part]:
        if self.parser is None:
            return [Text(text)]
        return self._shown(self.parser.feed(text))

    def end(self, reason: str) -> tuple[list[Part], str]:
        """What was held back, and the finish reason."""
        if self.parser is None:
            return [], reason
        parts = self._shown(self.parser.finish())
        return parts, "tool_calls" if self.parser.calls and reason == "stop" else reason

    def _shown(self, parts: list[Part]) -> list[Part]:
        assert self.parser is not None
        calls = self.parser.calls
        return [p for p in parts if not isinstance(p, Text) or p.text.strip() or not calls]


@dataclass
class _Choice:
    """What one choice of a streamed reply holds between chunks."""

    output: Output
    offset: int = 0  # characters of its text before the next chunk's (text_offset)
    held: tuple[Logprob, ...] = ()  # logprobs of text the call parser holds back
    streamed: set[str] = field(default_factory=set)  # ids of calls streamed as written


@dataclass
class Reply:
    """One response's identity; builds its chunks and its whole body, for `n` choices (each
    chunk names its choice's index). With `logprobs`, each choice carries its tokens'
    log-probabilities in the endpoint's shape. With `tools` (the syntax the model writes
    calls in), calls in the text become `tool_calls`."""

    chat: bool
    model: str
    logprobs: bool = False
    tools: Syntax | None = None
    n: int = 1
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    _choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self._choices = [self._new_choice() for _ in range(self.n)]

    def _new_choice(self) -> _Choice:
        return _Choice(Output(self.tools, partial=True))

    def delta_chunks(self, delta: Delta, index: int = 0) -> list[dict[str, Any]]:
        """The streamed chunks of a delta: its text, or (with tools) the text and calls it
        completes."""
        c = self._choices[index]
        return self._parts(index, c.output.feed(delta.text), delta.logprobs)

    def end_chunks(self, reason: str, index: int = 0) -> list[dict[str, Any]]:
        """The chunks that end a choice's stream: text held back, then the finish reason."""
        parts, finish = self._choices[index].output.end(reason)
        return [*self._parts(index, parts, ()), self.chunk(None, finish=finish, index=index)]

    def _parts(
        self, index: int, parts: list[Part], lps: tuple[Logprob, ...]
    ) -> list[dict[str, Any]]:
        c = self._choices[index]
        c.held += lps
        out = []
        for part in parts:
            call: dict[str, Any] | None = None
            if isinstance(part, CallStart):  # its arguments follow as they are written
                fn = {"name": part.name, "arguments": ""}
                call = {"index": part.index, "id": part.id, "type": "function", "function": fn}
            elif isinstance(part, ArgsDelta):
                call = {"index": part.index, "function": {"arguments": part.text}}
            elif isinstance(part, Call):
                if part.id in c.streamed:
                    continue  # its start and arguments went already
                assert c.output.parser is not None
                at = c.output.parser.calls.index(part)
                call = {"index": at, **part.as_dict()}
            if call is not None:
                if isinstance(part, CallStart):
                    c.streamed.add(part.id)
                delta = {"tool_calls": [call]}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                out.append(self._envelope("chat.completion.chunk", [choice]))
            else:
                out.append(self.chunk(part.text, logprobs=c.held, index=index))
                c.held = ()
        return out

    def _logprobs(self, c: _Choice, lps: tuple[Logprob, ...]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps)
        offsets = []
        for lp in lps:
            offsets.append(c.offset)
            c.offset += len(_token_text(lp.token))
        return {
            "tokens": [_token_text(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def opening(self) -> list[dict[str, Any]]:
        """The first streamed chunks (chat announces the assistant role of each choice)."""
        if not self.chat:
            return []
        return [self.chunk(None, role=True, index=i) for i in range(self.n)]

    def chunk(
        self,
        text: str | None,
        *,
        finish: str | None = None,
        role: bool = False,
        logprobs: tuple[Logprob, ...] = (),
        index: int = 0,
    ) -> dict:
        lps = self._logprobs(self._choices[index], logprobs) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(done)}

    def whole(self, echo: str, deltas: list[list[Delta]], dones: list[Finished]) -> dict[str, Any]:
        """The whole body: each choice's deltas and end, in index order."""
        choices = [
            self._whole_choice(i, echo, d, done)
            for i, (d, done) in enumerate(zip(deltas, dones, strict=True))
        ]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(merged(dones))
        return body

    def _whole_choice(
        self, index: int, echo: str, deltas: list[Delta], done: Finished
    ) -> dict[str, Any]:
        c = self._new_choice()
        text = echo + "".join(d.text for d in deltas)
        lps = self._logprobs(c, tuple(lp for d in deltas for lp in d.logprobs))
        if not self.chat:
            if lps is not None:
                lps["text_offset"] = [len(echo) + o for o in lps["text_offset"]]
            return {"index": index, "text": text, "logprobs": lps, "finish_reason": done.reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parser = c.output.parser
        if parser is not None:
            parts = parser.feed(text) + parser.finish()
            calls = [p.as_dict() for p in parts if isinstance(p, Call)]
            said = "".join(p.text for p in parts if isinstance(p, Text)).strip()
            if calls:
                message = {"role": "assistant", "content": said or None, "tool_calls": calls}
        _, finish = c.output.end(done.reason)
        return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}


def merged(dones: list[Finished]) -> Finished:
    """The end of n completions of one prompt, as usage counts it: the prompt once (cached
    what the one that prefilled it was given), every completion's tokens."""
    first = dones[0]
    if len(dones) == 1:
        return first
    total = sum(d.completion_tokens for d in dones)
    cached = min(d.cached_tokens for d in dones)
    return replace(first, completion_tokens=total, cached_tokens=cached)
