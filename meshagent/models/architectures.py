"""Which model architectures can be cut into stages, and why the others cannot."""

from __future__ import annotations

# Architectures whose slice of layers [a, b), renumbered from 0, computes exactly what those
# layers compute inside the whole model, once the slicer and the stage engine have done what
# the tables below say. Each has a parity test (tests/engine/test_stage_parity.py). `llama`
# includes its mixture-of-experts form (Mixtral); `qwen2moe` has a shared expert besides the
# routed ones; `deepseek2` (DeepSeek-V2/V3) chooses its leading dense layers by index, which
# the slicer rewrites for each slice (`models/slicer.py`, `LEADING_DENSE_KEY`). Gemma 2 and 3,
# Cohere 2 and gpt-oss alternate sliding-window and global layers by index (`SWA_PATTERN`).
SPLITTABLE = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "phi3",
        "qwen2moe",
        "qwen3moe",
        "deepseek2",
        "gemma",
        "gemma2",
        "gemma3",
        "cohere2",
        "gpt-oss",
    }
)

# Families whose sliding window, where their metadata names one, is the same for every layer
# or not applied at all: a slice computes what its layers compute in the whole model. Phi-3's
# window is disabled by llama.cpp (it warns "Phi SWA is currently disabled"); should it come
# back, it would apply to every layer alike. tests/engine/test_stage_parity.py checks a
# Phi-3 with a window split exactly.
WINDOW_NOT_BY_INDEX = frozenset({"phi3"})

# Families that alternate sliding-window and global layers by layer index: llama.cpp marks
# layer i as windowed when i % n < n - 1 (n the family's default here, or the model's
# `sliding_window_pattern` number), unless the model gives one flag per layer. The slicer
# writes each slice's flags as that per-layer array (`slicer.SWA_PATTERN_KEY`). Everything
# else these families' graphs choose by layer index follows the same flag: Gemma 3's and
# gpt-oss's RoPE base (`rope.freq_base_swa` on windowed layers), and Cohere 2's RoPE itself
# (only its windowed layers apply it).
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}

# Families that multiply the input embeddings by sqrt(n_embd) inside the graph. llama.cpp's
# Gemma 3 does it only to token ids, so a stage fed hidden states skips it and the entry
# applies it instead (`slicer.TokenEmbeddings`). Gemma 1 and 2 do it to any input: the first
# stage's input is the raw embedding, as in the whole model, and every later stage puts back
# the unscaled input it was given (the capture hook's restore, `engine/native.py`).
INPUT_SCALED_FOR_TOKENS = frozenset({"gemma3"})
INPUT_SCALED_ALWAYS = frozenset({"gemma", "gemma2"})
INPUT_SCALE_TENSOR = "inp_scaled"  # llama.cpp's name for the scaled input

# Families whose llama.cpp graph chooses a constant by the whole model's layer count: Gemma 2
# 27B (46 layers) and Gemma 3 27B (62) scale attention by n_embd / n_head rather than the head
# width. A slice has fewer layers, so it would use the other scale.
SCALE_BY_LAYER_COUNT = {"gemma2": 46, "gemma3": 62}


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
    "falcon-h1": "mixes attention and state-space layers by layer index",
}


def stage_refusal(
    arch: str,
    metadata_keys: set[str],
    *,
    n_layers: int = 0,
    n_embd: int = 0,
    n_head: int = 0,
    head_dim: int = 0,
) -> str | None:
    """None if the stage engine can run a slice of `arch` exactly; else the reason it cannot."""
    if arch in _REFUSED:
        return f"architecture {arch!r} {_REFUSED[arch]}"
    if arch not in SPLITTABLE and arch not in CERTIFIABLE:
        supported = sorted(SPLITTABLE | CERTIFIABLE.keys())
        return (
            f"architecture {arch!r} has no parity test for split serving yet "
            f"(supported: {', '.join(supported)})"
        )
    windowed = f"{arch}.attention.sliding_window" in metadata_keys
    if windowed and arch not in WINDOW_NOT_BY_INDEX and arch not in SWA_PATTERN:
        return f"this {arch} model uses sliding-window attention chosen by layer index"
    if SCALE_BY_LAYER_COUNT.get(arch) == n_layers and n_head and n_embd // n_head != head_dim:
        return (
            f"llama.cpp scales this {arch} model's attention by its layer count ({n_layers} "
            "layers: the 27B's n_embd / n_head), which a slice of fewer layers would not"
        )
    return None


def split_refusal(arch: str, metadata_keys: set[str], **shape: int) -> str | None:
    """None if `arch` can be split by default; else the reason it cannot (it can still be
    served whole). `shape`: as for `stage_refusal`."""
    refusal = stage_refusal(arch, metadata_keys, **shape)
    if refusal is None and arch in CERTIFIABLE:
        return (
            f"architecture {arch!r} keeps a recurrent state per sequence; it is split only "
            "once certified"
        )
    return refusal
