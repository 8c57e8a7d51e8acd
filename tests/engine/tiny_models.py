"""Tiny random-weight GGUF models of the split architectures, written with `gguf`."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 259  # 3 specials + 256 byte tokens


def write_tiny_model(
    path: Path,
    arch: str,
    *,
    n_layers: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    seed: int = 0,
    sliding_window: int | None = None,
) -> Path:
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([2, 3, 3] + [6] * 256)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def t(name: str, *shape: int, scale: float = 0.08) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", N_VOCAB, n_embd, scale=0.5)
    ones("output_norm.weight", n_embd)
    t("output.weight", N_VOCAB, n_embd, scale=0.2)
    for i in range(n_layers):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", n_embd)
        t(p + "attn_q.weight", n_head * head_dim, n_embd)
        t(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_output.weight", n_embd, n_head * head_dim)
        if arch == "qwen2":
            t(p + "attn_q.bias", n_head * head_dim, scale=0.05)
            t(p + "attn_k.bias", n_head_kv * head_dim, scale=0.05)
            t(p + "attn_v.bias", n_head_kv * head_dim, scale=0.05)
        if arch == "qwen3":
            ones(p + "attn_q_norm.weight", head_dim)
            ones(p + "attn_k_norm.weight", head_dim)
        ones(p + "ffn_norm.weight", n_embd)
        t(p + "ffn_gate.weight", n_ff, n_embd)
        t(p + "ffn_up.weight", n_ff, n_embd)
        t(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
