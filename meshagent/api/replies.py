"""The JSON shapes of chat and text completions, whole and streamed."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from meshagent.api.tools import Call, CallParser, Syntax, Text
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
        # Drafts from the request's own text: windows verified, draft tokens sent, how many
        # of them were right (each one a step saved), and the most windows in flight at once.
        s = done.speculation
        receipt["speculation"] = {
            "windows": s.windows,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "peak_windows_in_flight": s.peak_in_flight,
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


@dataclass
class Reply:
    """One response's identity; builds its chunks and its whole body. With `logprobs`, each
    choice carries its tokens' log-probabilities in the endpoint's shape. With `tools` (the
    syntax the model writes calls in), calls in the text become `tool_calls`."""

    chat: bool
    model: str
    logprobs: bool = False
    tools: Syntax | None = None
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # characters of completion text before the next chunk's (text_offset)
    _calls: CallParser | None = None
    _held: tuple[Logprob, ...] = ()  # logprobs of text the call parser holds back

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        if self.tools is not None:
            self._calls = CallParser(self.tools)

    def delta_chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The streamed chunks of a delta: its text, or (with tools) the text and calls it
        completes."""
        if self._calls is None:
            return [self.chunk(delta.text, logprobs=delta.logprobs)]
        return self._parts(self._calls.feed(delta.text), delta.logprobs)

    def end_chunks(self, reason: str) -> list[dict[str, Any]]:
        """The chunks that end a stream: text held back, then the finish reason."""
        parts = [] if self._calls is None else self._parts(self._calls.finish(), ())
        return [*parts, self.chunk(None, finish=self.finish_reason(reason))]

    def finish_reason(self, reason: str) -> str:
        if self._calls is not None and self._calls.calls and reason == "stop":
            return "tool_calls"
        return reason

    def _parts(self, parts: list[Text | Call], lps: tuple[Logprob, ...]) -> list[dict[str, Any]]:
        assert self._calls is not None
        self._held += lps
        out = []
        for part in parts:
            if isinstance(part, Call):
                index = self._calls.calls.index(part)
                out.append(self._choice_chunk({"tool_calls": [{"index": index, **part.as_dict()}]}))
            elif part.text.strip() or not self._calls.calls:  # no blank lines between calls
                out.append(self.chunk(part.text, logprobs=self._held))
                self._held = ()
        return out

    def _choice_chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def _logprobs(self, lps: tuple[Logprob, ...]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(lps)
        offsets = []
        for lp in lps:
            offsets.append(self._offset)
            self._offset += len(_token_text(lp.token))
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

    def opening(self) -> dict[str, Any] | None:
        """The first streamed chunk (chat announces the assistant role)."""
        if not self.chat:
            return None
        return self.chunk(None, role=True)

    def chunk(
        self,
        text: str | None,
        *,
        finish: str | None = None,
        role: bool = False,
        logprobs: tuple[Logprob, ...] = (),
    ) -> dict:
        lps = self._logprobs(logprobs) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(done)}

    def whole(self, echo: str, deltas: list[Delta], done: Finished) -> dict[str, Any]:
        text = echo + "".join(d.text for d in deltas)
        lps = self._logprobs(tuple(lp for d in deltas for lp in d.logprobs))
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._calls is not None:
                parts = self._calls.feed(text) + self._calls.finish()
                calls = [p.as_dict() for p in parts if isinstance(p, Call)]
                said = "".join(p.text for p in parts if isinstance(p, Text)).strip()
                if calls:
                    message = {"role": "assistant", "content": said or None, "tool_calls": calls}
            choice = {
                "index": 0,
                "message": message,
                "logprobs": lps,
                "finish_reason": self.finish_reason(done.reason),
            }
            body = self._envelope("chat.completion", [choice])
        else:
            if lps is not None:
                lps["text_offset"] = [len(echo) + o for o in lps["text_offset"]]
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": done.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(done)
        return body
