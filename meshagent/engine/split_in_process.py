"""A whole pipeline of stages in one process, behind the `Engine` interface.

The entry (tokenizer and token embeddings) and every stage load their own artifacts, exactly as
they would on separate peers; hidden states pass between stages in the wire dtype. Used to
certify a model for split serving (`models/certify.py`), by parity tests and by benchmarks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshagent.engine.base import ForwardItem, ModelInfo
from meshagent.engine.llama import model_id_for
from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import WIRE_DTYPES, StageEngine
from meshagent.engine.vocab import Vocab, VocabDelegate
from meshagent.errors import EngineError, ModelError
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.layout import ModelLayout, inspect_model
from meshagent.models.slicer import TokenEmbeddings


class StagedEngine(VocabDelegate):
    def __init__(
        self,
        model: Path,
        boundaries: Sequence[int],
        store: ArtifactStore,
        *,
        slots: int = 4,
        slot_ctx: int = 2048,
        threads: int = 0,
        wire_dtype: str = "f32",
        max_batch_tokens: int = 512,
        flash_attn: bool = False,
        layout: ModelLayout | None = None,  # the model's, if the caller has it already
        gpu_layers: int = 0,  # each stage's layers offloaded to GPUs (llama.cpp n_gpu_layers)
    ) -> None:
        layout = layout or inspect_model(model)
        # Certification runs this on families the planner does not split by default.
        if layout.stage_refusal:
            raise ModelError(f"cannot split {model.name}: {layout.stage_refusal}")
        bounds = list(boundaries)
        if bounds[0] != 0 or bounds[-1] != layout.n_layers or bounds != sorted(set(bounds)):
            raise EngineError(f"stage boundaries {bounds} must rise from 0 to {layout.n_layers}")
        if wire_dtype not in WIRE_DTYPES:
            raise EngineError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}")
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        entry_path, _ = store.ensure_entry(model, layout)
        self.vocab = Vocab.load(entry_path)
        self.embed = TokenEmbeddings(entry_path)
        self.stages = [
            StageEngine(
                store.ensure_layers(model, a, b, layout)[0],
                start=a,
                end=b,
                total_layers=layout.n_layers,
                slots=slots,
                slot_ctx=slot_ctx,
                threads=threads,
                max_batch_tokens=max_batch_tokens,
                flash_attn=flash_attn,
                gpu_layers=gpu_layers,
            )
            for a, b in itertools.pairwise(bounds)
        ]
        self.n_slots = slots
        self.slot_ctx = slot_ctx
        self.info = ModelInfo(
            id=model_id_for(model),
            path=str(model),
            architecture=layout.architecture,
            n_layers=layout.n_layers,
            n_vocab=self.vocab.n_vocab,
            n_ctx_train=layout.context_length,
            size_bytes=layout.file_bytes,
            chat_template=self.vocab.chat_template(),
            bos_token=self.vocab.bos_token,
            eos_token=self.vocab.eos_token,
            fim=self.vocab.fim(),
        )

    def forward(self, items: Sequence[ForwardItem]) -> list[np.ndarray | None]:
        hidden = [self.embed(list(it.tokens)) for it in items]
        for stage in self.stages:
            batch = [
                EmbdItem(it.seq_id, it.pos, h, it.rows if it.want_logits and stage.last else 0)
                for it, h in zip(items, hidden, strict=True)
            ]
            out = stage.forward(batch)
            if out.hidden is None:
                return out.logits
            # What would cross the wire: the activations in the wire dtype.
            hidden = [h.astype(self.wire_dtype) for h in out.hidden]
        raise EngineError("the last stage returned no logits")

    def clear_sequence(self, seq_id: int) -> None:
        for stage in self.stages:
            stage.clear_sequence(seq_id)

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        # Refused before any stage changes: stages must never disagree about a sequence.
        for stage in self.stages:
            stage.runtime.check_trim(seq_id, keep)
        for stage in self.stages:
            stage.trim_sequence(seq_id, keep)

    def reset(self) -> None:
        for stage in self.stages:
            stage.reset()

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.stages)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()
        self.vocab.close()
