"""Text embeddings from a GGUF model: a llama.cpp context of its own in embedding mode, the
hidden states mean-pooled over an input's tokens and normalised to length 1.

The model loads as every meshagent model does (`runtime.load_model`), so the same guards apply
(on AMX CPUs no AMX-repacked weights: llama.cpp 0.3.36's AMX matrix multiply crashes the
process there). Blocking: run it on a worker thread, one input at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from meshagent.engine.base import check_tokens
from meshagent.engine.runtime import load_model
from meshagent.engine.vocab import Vocab
from meshagent.errors import EngineError


class LlamaEmbedder:
    def __init__(self, path: Path, *, n_ctx: int, threads: int) -> None:
        self.n_ctx = n_ctx
        self.model = load_model(path)
        self._vocab = Vocab(self.model)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx  # an input is pooled in one batch
        cp.n_seq_max = 1
        cp.embeddings = True
        cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not ctx:
            llama_cpp.llama_model_free(self.model)
            raise EngineError(f"llama.cpp could not create an embedding context of {n_ctx} tokens")
        self.ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        """The input's tokens, with the model's BOS; special-token text stays plain text."""
        return self._vocab.tokenize(text, add_bos=True, special=False)

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The unit vector of one input's tokens (at most `n_ctx`)."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise EngineError(f"an input of {n} tokens does not fit {self.n_ctx}")
        check_tokens(tokens, self._vocab.n_vocab)
        llama_cpp.llama_memory_clear(self._memory, True)
        batch = self._batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True  # embedding mode reads every token's output
        batch.n_tokens = n
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise EngineError("llama.cpp failed to compute an embedding")
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not ptr:
            raise EngineError("llama.cpp returned no pooled embedding")
        vector = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float64)
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector

    def close(self) -> None:
        if self.ctx is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            self.ctx = None
