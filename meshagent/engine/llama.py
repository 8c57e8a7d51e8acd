"""The llama.cpp engine: a whole GGUF model, several sequences batched in one context."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog

from meshagent.engine.base import ForwardItem, ModelInfo
from meshagent.engine.runtime import (
    FLASH_ATTN_WINDOWS,
    LlamaRuntime,
    RuntimeDelegate,
    inexact_build,
    inexact_model,
    repack_on,
)
from meshagent.engine.vocab import Vocab, VocabDelegate

log = structlog.get_logger(__name__)


def model_id_for(path: Path) -> str:
    """The name clients use for a GGUF file: its file name without `.gguf`."""
    return path.name.removesuffix(".gguf")


def _weight_types(path: Path) -> tuple[str, ...]:
    """The model's weight types where they can make windows inexact here (repacking on)."""
    from meshagent.errors import ModelError
    from meshagent.models.layout import inspect_model

    if not repack_on():
        return ()  # the header is not read for nothing
    try:
        return inspect_model(path).weight_types
    except (ModelError, OSError, ValueError):  # only a hint's wording depends on it
        return ()


class LlamaEngine(VocabDelegate, RuntimeDelegate):
    """Implements `Engine` on llama.cpp. Each slot is one llama.cpp sequence."""

    def __init__(
        self,
        path: Path,
        *,
        slots: int = 4,
        slot_ctx: int = 2048,
        threads: int = 0,
        max_batch_tokens: int = 512,
        flash_attn: bool | None = False,
        gpu_layers: int = 0,
    ) -> None:
        self.runtime = LlamaRuntime(
            path,
            slots=slots,
            slot_ctx=slot_ctx,
            threads=threads,
            max_batch_tokens=max_batch_tokens,
            flash_attn=flash_attn,
            gpu_layers=gpu_layers,
        )
        self.vocab = Vocab(self.runtime.model)
        self.n_slots = slots
        self.slot_ctx = slot_ctx
        self.rewindable = self.runtime.rewindable
        # Read by `engine.windows.check_windows`: flash attention is not checked, a LLAMAFILE
        # build, llama.cpp's tiled kernels or repacked weights are (and, when the check
        # fails, told how to mend).
        self.inexact_windows = None if flash_attn is False else FLASH_ATTN_WINDOWS
        self.windows_hint = inexact_build() or inexact_model(_weight_types(path)) or None
        self.n_vocab = self.vocab.n_vocab
        rt = self.runtime
        self.info = ModelInfo(
            id=model_id_for(path),
            path=str(path),
            architecture=rt.meta("general.architecture") or "unknown",
            n_layers=rt.n_layers,
            n_vocab=self.n_vocab,
            n_ctx_train=int(rt.meta(f"{rt.meta('general.architecture')}.context_length") or 0),
            size_bytes=path.stat().st_size,
            chat_template=self.vocab.chat_template(),
            bos_token=self.vocab.bos_token,
            eos_token=self.vocab.eos_token,
            fim=self.vocab.fim(),
        )
        log.info(
            "engine.loaded",
            model=self.info.id,
            arch=self.info.architecture,
            layers=self.info.n_layers,
            slots=slots,
            slot_ctx=slot_ctx,
            threads=rt.threads,
        )

    def forward(self, items: Sequence[ForwardItem]) -> list[np.ndarray | None]:
        return self.runtime.decode_tokens(
            [(it.seq_id, it.pos, it.tokens, it.rows if it.want_logits else 0) for it in items]
        )


def read_model_info(path: Path) -> ModelInfo:
    """A model's serving facts without loading its weights (vocabulary only)."""
    from meshagent.models.layout import inspect_model
    from meshagent.models.ranged import header_gaps

    layout = inspect_model(path)
    facts = (layout.n_vocab, None, "", "")
    if not header_gaps(path):
        # (A partial copy read without its tokenizer has none: it serves stages, and an
        # entry reads the vocabulary from its own artifact.)
        vocab = Vocab.load(path)
        try:
            facts = (vocab.n_vocab, vocab.chat_template(), vocab.bos_token, vocab.eos_token)
        finally:
            vocab.close()
    n_vocab, template, bos, eos = facts
    return ModelInfo(
        id=model_id_for(path),
        path=str(path),
        architecture=layout.architecture,
        n_layers=layout.n_layers,
        n_vocab=n_vocab,
        n_ctx_train=layout.context_length,
        size_bytes=layout.file_bytes,
        chat_template=template,
        bos_token=bos,
        eos_token=eos,
    )
