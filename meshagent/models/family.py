"""A model family's traits as the stage engine sees them: what each layer is, what state a
sequence keeps, where a cut changes layer type. A plain function of the GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from meshagent.models.architectures import CERTIFIABLE
from meshagent.models.layout import ModelLayout

ATTENTION = "attention"
RECURRENT = "recurrent"
UNKNOWN = "unknown"  # a hybrid family whose layer pattern is not modelled here

# llama.cpp keeps these in recurrent memory only (llm_arch_is_recurrent): one state per sequence.
RECURRENT_ARCHITECTURES = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# And these in hybrid memory (llm_arch_is_hybrid): a KV cache for the attention layers and a
# recurrent state for the others, whatever mix of layers a slice holds.
HYBRID_ARCHITECTURES = frozenset(
    {
        "jamba",
        "falcon-h1",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "plamo2",
        "qwen3next",
        "qwen35",
        "qwen35moe",
        "kimi-linear",
    }
)
# Hybrids whose recurrent layers are the ones with head_count_kv 0 (llama.cpp's hparams loader
# for each of them), so a slice keeps its pattern by cutting that array.
_RECURRENT_WHERE_NO_KV_HEADS = frozenset({"jamba", "granitehybrid", "lfm2", "lfm2moe"})


@dataclass(frozen=True)
class FamilyTraits:
    splittable: bool  # the planner may split the model without a certification record
    certifiable: bool  # the stage engine runs its slices exactly; split once certified
    layer_types: tuple[str, ...]  # per layer: "attention", "recurrent" (or "unknown")
    state_kind: str  # per sequence: "kv" (a cache per position), "recurrent", "hybrid"
    state_portable: bool  # llama_state_seq_get_data/set_data move one sequence's state
    rewindable: bool  # a sequence can be cut back to an earlier position (trim)
    type_boundaries: tuple[int, ...]  # cut points c where layer c-1 and layer c differ in type


def family_traits(layout: ModelLayout) -> FamilyTraits:
    """The traits of `layout`'s model family, from its architecture and per-layer metadata."""
    arch = layout.architecture
    n = layout.n_layers
    if arch in RECURRENT_ARCHITECTURES:
        state_kind = "recurrent"
        types = (RECURRENT,) * n
    elif arch in HYBRID_ARCHITECTURES:
        state_kind = "hybrid"
        if arch in _RECURRENT_WHERE_NO_KV_HEADS:
            types = tuple(RECURRENT if h == 0 else ATTENTION for h in layout.layer_n_head_kv)
        else:
            types = (UNKNOWN,) * n
    else:
        state_kind = "kv"
        types = (ATTENTION,) * n
    return FamilyTraits(
        splittable=layout.splittable,
        certifiable=arch in CERTIFIABLE and layout.stage_refusal is None,
        layer_types=types,
        state_kind=state_kind,
        # llama.cpp serialises one sequence's KV cells and recurrent cells alike
        # (llama_state_seq_get_data / llama_state_seq_set_data); tests/engine checks it.
        state_portable=True,
        # A recurrent state is the sequence's summary after its last token: llama.cpp refuses
        # to remove part of it (llama_memory_seq_rm returns false), only all of it.
        rewindable=state_kind == "kv",
        type_boundaries=tuple(c for c in range(1, n) if types[c - 1] != types[c]),
    )
