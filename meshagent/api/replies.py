"""The JSON shapes of chat and text completions, whole and streamed."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

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
    choice carries its tokens' log-probabilities in the endpoint's shape."""

    chat: bool
    model: str
    logprobs: bool = False
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # characters of completion text before the next chunk's (text_offset)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

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
            message = {"role": "assistant", "content": text}
            choice = {
                "index": 0,
                "message": message,
                "logprobs": lps,
                "finish_reason": done.reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            if lps is not None:
                lps["text_offset"] = [len(echo) + o for o in lps["text_offset"]]
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": done.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(done)
        return body
