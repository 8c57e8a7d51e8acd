"""Which model architectures can be cut into stages, and why the others cannot."""

from __future__ import annotations

# Architectures whose layer graph does not depend on the absolute layer index and whose input
# is the plain token embedding: a slice of layers [a, b) renumbered from 0 computes exactly what
# those layers compute inside the whole model. Each has a parity test.
SPLITTABLE = frozenset({"llama", "qwen2", "qwen3"})

_REFUSED = {
    "gemma": "scales the input embeddings inside the graph",
    "gemma2": "scales the input embeddings and alternates sliding-window layers by layer index",
    "gemma3": "scales the input embeddings and alternates sliding-window layers by layer index",
    "cohere2": "alternates sliding-window layers by layer index",
    "deepseek2": "has leading dense layers chosen by absolute layer index",
    "jamba": "mixes attention and state-space layers by layer index",
    "falcon-h1": "mixes attention and state-space layers by layer index",
}


def split_refusal(arch: str, metadata_keys: set[str]) -> str | None:
    """None if `arch` can be split; else the reason it cannot (it can still be served whole)."""
    if arch in _REFUSED:
        return f"architecture {arch!r} {_REFUSED[arch]}"
    if arch not in SPLITTABLE:
        return (
            f"architecture {arch!r} has no parity test for split serving yet "
            f"(supported: {', '.join(sorted(SPLITTABLE))})"
        )
    if f"{arch}.attention.sliding_window" in metadata_keys:
        return f"this {arch} model uses sliding-window attention chosen by layer index"
    return None
