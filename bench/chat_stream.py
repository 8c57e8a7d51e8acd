"""A streamed chat completion as the benchmarks read it: its text, its usage, and when its
first content and its end arrived."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from meshagent.sse_client import chunk_text, iter_events


@dataclass(frozen=True)
class Streamed:
    text: str
    usage: dict[str, Any]
    first: float  # time.perf_counter() at the first content
    end: float  # ... and after the last event


def stream_chat(url: str, body: dict[str, Any], timeout: float = 600) -> Streamed:
    """POST `body` (with "stream": true and usage included) to `url`'s chat endpoint."""
    text, usage, first = "", None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for event in iter_events(r):
            if event.done:
                continue
            chunk = event.json()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if piece := chunk_text(chunk):
                text += piece
                if first is None:
                    first = time.perf_counter()
    assert usage is not None and first is not None, "a stream without content or usage"
    return Streamed(text, usage, first, time.perf_counter())
