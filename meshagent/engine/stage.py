"""A stage: layers [start, end) of a model, hidden states in, hidden states or logits out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshagent.engine.grammar import GrammarConstraint
from meshagent.engine.native import Capture
from meshagent.engine.runtime import EmbdItem, LlamaRuntime, RuntimeDelegate
from meshagent.engine.vocab import Vocab
from meshagent.errors import EngineError
from meshagent.models.architectures import INPUT_SCALE_TENSOR, INPUT_SCALED_ALWAYS
from meshagent.models.layout import field, open_gguf
from meshagent.models.slicer import PAD_LAYERS_KEY, SLICE_KEY_PREFIX
from meshagent.wording import layer_range

WIRE_DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True)
class StageOutput:
    """Per item: the residual rows after this stage (non-last stages) or the logits of the
    item's last token (last stage, items that asked)."""

    hidden: list[np.ndarray] | None
    logits: list[np.ndarray | None]


class StageEngine(RuntimeDelegate):
    def __init__(
        self,
        layers_path: Path,
        *,
        start: int,
        end: int,
        total_layers: int,
        slots: int = 4,
        slot_ctx: int = 2048,
        threads: int = 0,
        max_batch_tokens: int = 512,
        flash_attn: bool | None = False,
        gpu_layers: int = 0,
    ) -> None:
        if not 0 <= start < end <= total_layers:
            raise EngineError(
                f"layer range {layer_range(start, end)} is outside {layer_range(0, total_layers)}"
            )
        self.start = start
        self.end = end
        self.last = end == total_layers
        self.flash_attn = flash_attn
        # Gemma 1 and 2 scale whatever enters the graph: a later stage puts its input back.
        arch = field(open_gguf(layers_path), "general.architecture", "")
        restore = INPUT_SCALE_TENSOR if start > 0 and arch in INPUT_SCALED_ALWAYS else ""
        self.restores = bool(restore)
        # The capture is named once the slice is loaded: see below.
        capture = (
            None
            if self.last and not restore
            else Capture("" if self.last else "l_out-0", restore=restore)
        )
        self.runtime = LlamaRuntime(
            layers_path,
            slots=slots,
            slot_ctx=slot_ctx,
            threads=threads,
            max_batch_tokens=max_batch_tokens,
            unified_kv=False,
            flash_attn=flash_attn,
            capture=capture,
            gpu_layers=gpu_layers,
        )
        # A hybrid's slice may start with zero layers that pass their input on (see
        # slicer.pad_layer); llama.cpp numbers them with the slice's own.
        n_layers = int(self.runtime.meta(SLICE_KEY_PREFIX + PAD_LAYERS_KEY) or 0) + end - start
        if self.runtime.n_layers != n_layers:
            self.runtime.close()
            raise EngineError(
                f"{layers_path} holds {self.runtime.n_layers} layers, expected {n_layers}"
            )
        if capture is not None and not self.last:
            # The residual after the slice's last layer; llama.cpp names it l_out-<layer>. The
            # hook reads the name at every decode, so it may be set after the context exists.
            capture.target(f"l_out-{n_layers - 1}")
        self.n_embd = self.runtime.n_embd
        self._vocab: Vocab | None = None  # the last stage's, for grammars (`constraint`)
        self.n_slots = slots
        self.slot_ctx = slot_ctx
        self.max_batch_tokens = self.runtime.max_batch_tokens  # rows one forward may take

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> GrammarConstraint:
        """The grammar `text` as a sampling constraint over the model's vocabulary (the
        stage's file keeps the tokenizer: the last stage samples)."""
        if self._vocab is None:
            self._vocab = Vocab(self.runtime.model)
        return self._vocab.constraint(text, trigger, close_within)

    def forward(self, items: Sequence[EmbdItem]) -> StageOutput:
        for it in items:
            if it.hidden.ndim != 2 or it.hidden.shape[1] != self.n_embd:
                raise EngineError(
                    f"hidden states of shape {it.hidden.shape}, expected (n, {self.n_embd})"
                )
        prepared = [
            it
            if it.hidden.dtype == np.float32
            else EmbdItem(it.seq_id, it.pos, it.hidden.astype(np.float32), it.want_logits)
            for it in items
        ]
        if self.last and not self.restores:
            return StageOutput(None, self.runtime.decode_embd(prepared)[1])
        hidden: list[np.ndarray | None] = [None] * len(items)
        logits: list[np.ndarray | None] = [None] * len(items)
        for group in _row_order_safe_groups(prepared):
            rows, lg = self.runtime.decode_embd([prepared[i] for i in group])
            for j, i in enumerate(group):
                hidden[i] = None if rows is None else rows[j]
                logits[i] = lg[j]
        return StageOutput(None if self.last else hidden, logits)  # type: ignore[arg-type]


def _row_order_safe_groups(items: Sequence[EmbdItem]) -> list[list[int]]:
    """Split a batch into llama_decode calls whose captured (or restored) rows are in batch
    order.

    With a KV stream per sequence, llama.cpp splits a batch into micro-batches holding the
    same number of tokens of every sequence, reordering rows when sequences bring different
    numbers of tokens; the captured tensor is in micro-batch order. Single-token items (decode
    steps) go in one call (the runtime orders them by sequence id, which keeps rows in order);
    each longer item (a prompt chunk) gets its own call.
    Keeping a KV stream per sequence is what makes a batched sequence compute exactly what it
    computes alone.
    """
    singles = [i for i, it in enumerate(items) if it.hidden.shape[0] == 1]
    groups = [singles] if singles else []
    groups += [[i] for i, it in enumerate(items) if it.hidden.shape[0] != 1]
    return groups
