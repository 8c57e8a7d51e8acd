"""The JSON shapes of chat and text completions, whole and streamed."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from meshagent.serving.generation import Finished


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


@dataclass
class Reply:
    """One response's identity; builds its chunks and its whole body."""

    chat: bool
    model: str
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)

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

    def chunk(self, text: str | None, *, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(done)}

    def whole(self, text: str, done: Finished) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": done.reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(done)
        return body
