"""Which model architectures can be cut into stages, and why the others cannot."""

from __future__ import annotations

# Architectures whose layer graph does not depend on the absolute layer index and whose input
# is the plain token embedding: a slice of layers [a, b) renumbered from 0 computes exactly what
# those layers compute inside the whole model. Each has a parity test. `llama` includes its
# mixture-of-experts form (Mixtral); `qwen2moe` has a shared expert besides the routed ones;
# `deepseek2` (DeepSeek-V2/V3) chooses its leading dense layers by index, which the slicer
# rewrites for each slice (`models/slicer.py`, `LEADING_DENSE_KEY`).
SPLITTABLE = frozenset({"llama", "qwen2", "qwen3", "phi3", "qwen2moe", "qwen3moe", "deepseek2"})

# Families whose sliding window, where their metadata names one, is the same for every layer
# or not applied at all: a slice computes what its layers compute in the whole model. Phi-3's
# window is disabled by llama.cpp (it warns "Phi SWA is currently disabled"); should it come
# back, it would apply to every layer alike. tests/engine/test_stage_parity.py checks a
# Phi-3 with a window split exactly.
WINDOW_NOT_BY_INDEX = frozenset({"phi3"})

# Architectures that keep a recurrent state per sequence, which the stage engine runs exactly
# (tests/engine/test_recurrent_parity.py) but which are split only for a model that holds a
# certification record: their state cannot be rewound, so what serving does with a sequence
# (trimming a rejected draft, reusing a cached prefix) differs from the attention-only models.
CERTIFIABLE = {
    "mamba": "every layer is a Mamba state-space mixer: one conv + scan state per sequence, "
    "kept by each stage for its own layers",
    "jamba": "attention and Mamba layers chosen by a per-layer head_count_kv array (0 marks a "
    "Mamba layer), which the slicer cuts with the layers; a KV cache and a recurrent state "
    "per sequence in every stage",
}

_REFUSED = {
    "gemma": "scales the input embeddings inside the graph",
    "gemma2": "scales the input embeddings and alternates sliding-window layers by layer index",
    "gemma3": "scales the input embeddings and alternates sliding-window layers by layer index",
    "cohere2": "alternates sliding-window layers by layer index",
    "falcon-h1": "mixes attention and state-space layers by layer index",
}


def stage_refusal(arch: str, metadata_keys: set[str]) -> str | None:
    """None if the stage engine can run a slice of `arch` exactly; else the reason it cannot."""
    if arch in _REFUSED:
        return f"architecture {arch!r} {_REFUSED[arch]}"
    if arch not in SPLITTABLE and arch not in CERTIFIABLE:
        supported = sorted(SPLITTABLE | CERTIFIABLE.keys())
        return (
            f"architecture {arch!r} has no parity test for split serving yet "
            f"(supported: {', '.join(supported)})"
        )
    if f"{arch}.attention.sliding_window" in metadata_keys and arch not in WINDOW_NOT_BY_INDEX:
        return f"this {arch} model uses sliding-window attention chosen by layer index"
    return None


def split_refusal(arch: str, metadata_keys: set[str]) -> str | None:
    """None if `arch` can be split by default; else the reason it cannot (it can still be
    served whole)."""
    refusal = stage_refusal(arch, metadata_keys)
    if refusal is None and arch in CERTIFIABLE:
        return (
            f"architecture {arch!r} keeps a recurrent state per sequence; it is split only "
            "once certified"
        )
    return refusal
