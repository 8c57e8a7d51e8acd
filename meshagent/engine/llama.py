"""The llama.cpp engine: a whole GGUF model, several sequences batched in one context."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import structlog

from meshagent.engine.base import ForwardItem, ModelInfo
from meshagent.errors import EngineError, ModelError

log = structlog.get_logger(__name__)

_LEVELS = {3: "warning", 4: "error"}  # ggml_log_level values worth surfacing


@llama_cpp.llama_log_callback
def _llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level in _LEVELS and text:
        getattr(log, _LEVELS[level])("llama.cpp", message=text.decode(errors="replace").strip())


_backend_ready = False


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        llama_cpp.llama_log_set(_llama_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


def model_id_for(path: Path) -> str:
    """The name clients use for a GGUF file: its file name without `.gguf`."""
    return path.name.removesuffix(".gguf")


class LlamaEngine:
    """Implements `Engine` on llama.cpp. Each slot is one llama.cpp sequence."""

    def __init__(
        self,
        path: Path,
        *,
        slots: int = 4,
        slot_ctx: int = 2048,
        threads: int = 0,
        max_batch_tokens: int = 512,
    ) -> None:
        if not path.is_file():
            raise ModelError(f"model file not found: {path}")
        _init_backend()
        self.n_slots = slots
        self.max_batch_tokens = max_batch_tokens
        mparams = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelError(f"llama.cpp could not load {path}: is it a valid GGUF model file?")
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = slot_ctx * slots
        cparams.n_batch = max_batch_tokens
        cparams.n_ubatch = max_batch_tokens
        cparams.n_seq_max = slots
        cparams.kv_unified = False  # every slot owns slot_ctx tokens of cache
        n_threads = threads or os.cpu_count() or 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise EngineError(
                f"llama.cpp could not create a context of {slots} x {slot_ctx} tokens; "
                "try a smaller --ctx-size or fewer --slots"
            )
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        self.slot_ctx = int(llama_cpp.llama_n_ctx_seq(ctx))
        self._batch = llama_cpp.llama_batch_init(max_batch_tokens, 0, 1)
        self._piece = ctypes.create_string_buffer(256)
        self._bytes_cache: dict[int, bytes] = {}
        self.info = self._read_info(path)
        log.info(
            "engine.loaded",
            model=self.info.id,
            arch=self.info.architecture,
            layers=self.info.n_layers,
            slots=slots,
            slot_ctx=self.slot_ctx,
            threads=n_threads,
        )

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return raw.decode(errors="replace") if raw else ""

    def _read_info(self, path: Path) -> ModelInfo:
        template = llama_cpp.llama_model_chat_template(self._model, None)
        return ModelInfo(
            id=model_id_for(path),
            path=str(path),
            architecture=self._meta("general.architecture") or "unknown",
            n_layers=int(llama_cpp.llama_model_n_layer(self._model)),
            n_vocab=self.n_vocab,
            n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(self._model)),
            size_bytes=path.stat().st_size,
            chat_template=template.decode() if template else None,
            bos_token=self._token_text(llama_cpp.llama_vocab_bos(self._vocab)),
            eos_token=self._token_text(llama_cpp.llama_vocab_eos(self._vocab)),
        )

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, True)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def token_bytes(self, token: int) -> bytes:
        cached = self._bytes_cache.get(token)
        if cached is None:
            n = llama_cpp.llama_token_to_piece(
                self._vocab, token, self._piece, len(self._piece), 0, False
            )
            cached = self._piece.raw[: max(n, 0)]
            self._bytes_cache[token] = cached
        return cached

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def forward(self, items: Sequence[ForwardItem]) -> list[np.ndarray | None]:
        batch = self._batch
        n = 0
        rows: list[int | None] = []
        for item in items:
            for i, tok in enumerate(item.tokens):
                if n >= self.max_batch_tokens:
                    raise EngineError(f"batch exceeds {self.max_batch_tokens} tokens")
                batch.token[n] = tok
                batch.pos[n] = item.pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = item.seq_id
                batch.logits[n] = False
                n += 1
            if item.want_logits:
                batch.logits[n - 1] = True
                rows.append(n - 1)
            else:
                rows.append(None)
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc}")
        out: list[np.ndarray | None] = []
        for row in rows:
            if row is None:
                out.append(None)
                continue
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out

    def clear_sequence(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def memory_bytes(self) -> int:
        return int(llama_cpp.llama_model_size(self._model)) + int(
            llama_cpp.llama_state_get_size(self._ctx)
        )

    def close(self) -> None:
        if self._ctx:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = None
