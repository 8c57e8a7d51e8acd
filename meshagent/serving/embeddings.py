"""Embeddings of a model served whole (`POST /v1/embeddings`): an embedding context of its own
(`engine/embedder.py`: mean-pooled over each input's tokens, normalised to length 1), opened at
the first request (it maps the same GGUF file, so its weights' pages are shared with the
serving engine's) and used by one request at a time on a worker thread.

A split has no agent holding every layer, so it has no embedder: the API says so."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from meshagent.errors import ContextOverflow

if TYPE_CHECKING:
    from meshagent.engine.embedder import LlamaEmbedder


class Embedder:
    def __init__(self, path: str, *, threads: int = 0, n_ctx: int = 2048) -> None:
        self.path, self.n_ctx = path, n_ctx
        self.threads = threads or os.cpu_count() or 1
        self._llm: LlamaEmbedder | None = None
        self._lock = trio.Lock()

    def _open(self) -> LlamaEmbedder:
        from meshagent.engine.embedder import LlamaEmbedder  # llama.cpp, at the first request

        return LlamaEmbedder(Path(self.path), n_ctx=self.n_ctx, threads=self.threads)

    async def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """One unit vector per text, and the tokens read. ContextOverflow for a text longer
        than the context."""
        async with self._lock:
            if self._llm is None:
                self._llm = await trio.to_thread.run_sync(self._open)
            llm = self._llm
            inputs = []
            for text in texts:
                tokens = llm.tokenize(text)
                if len(tokens) > self.n_ctx:
                    raise ContextOverflow(
                        f"An input is {len(tokens)} tokens long; this model embeds at most "
                        f"{self.n_ctx} tokens per input. Shorten it.",
                        prompt_tokens=len(tokens),
                        limit=self.n_ctx,
                    )
                inputs.append(tokens)
            vectors = await trio.to_thread.run_sync(lambda: [llm.embed(t) for t in inputs])
            return [list(map(float, v)) for v in vectors], sum(map(len, inputs))

    async def aclose(self) -> None:
        """Free the context, once no request uses it."""
        async with self._lock:
            if self._llm is not None:
                self._llm.close()
                self._llm = None
