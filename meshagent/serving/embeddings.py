"""Embeddings of a model served whole (`POST /v1/embeddings`): a llama.cpp context of its own
in embedding mode, mean-pooled over each input's tokens and normalised to length 1, opened at
the first request (it maps the same GGUF file, so its weights' pages are shared with the
serving engine's) and used by one request at a time on a worker thread.

A split has no agent holding every layer, so it has no embedder: the API says so."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import trio

from meshagent.errors import ContextOverflow


class Embedder:
    def __init__(self, path: str, *, threads: int = 0, n_ctx: int = 2048) -> None:
        self.path, self.n_ctx = path, n_ctx
        self.threads = threads or os.cpu_count() or 1
        self._llm: Any = None
        self._lock = trio.Lock()

    def _open(self) -> Any:
        import llama_cpp

        return llama_cpp.Llama(
            self.path,
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            n_ctx=self.n_ctx,
            n_batch=self.n_ctx,
            n_ubatch=self.n_ctx,  # an input is pooled in one batch: it must fit in one
            n_threads=self.threads,
            verbose=False,
        )

    async def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """One unit vector per text, and the tokens read. ContextOverflow for a text longer
        than the context."""
        async with self._lock:
            if self._llm is None:
                self._llm = await trio.to_thread.run_sync(self._open)
            llm = self._llm
            for text in texts:
                n = len(llm.tokenize(text.encode(), add_bos=True))
                if n > self.n_ctx:
                    raise ContextOverflow(
                        f"An input is {n} tokens long; this model embeds at most {self.n_ctx} "
                        "tokens per input. Shorten it.",
                        prompt_tokens=n,
                        limit=self.n_ctx,
                    )
            vectors, count = await trio.to_thread.run_sync(
                lambda: llm.embed(list(texts), normalize=True, truncate=False, return_count=True)
            )
            return [list(map(float, v)) for v in vectors], int(count)

    async def aclose(self) -> None:
        """Free the context, once no request uses it."""
        async with self._lock:
            if self._llm is not None:
                self._llm.close()
                self._llm = None
