"""Tiny random-weight GGUF models written with `gguf`: the split architectures (llama, qwen2,
qwen3, phi3, their MoE forms, deepseek2, Gemma 1-3, Cohere 2, gpt-oss), a pure state-space
model (mamba) and a hybrid of attention and state-space layers (jamba)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 259  # 3 specials + 256 byte tokens

# Jamba's layer types come from a per-layer head_count_kv array: 0 marks a state-space layer.
# This pattern puts type boundaries at 1, 2 and 4, so a 3-stage cut at 2 and 4 gives a mixed
# stage, a state-space-only stage and an attention-only stage.
JAMBA_PATTERN = ("recurrent", "attention", "recurrent", "recurrent", "attention", "attention")


class _Weights:
    """Adds random float32 tensors to a writer, reproducibly from a seed."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self.w = writer
        self.rng = np.random.default_rng(seed)

    def normal(self, name: str, *shape: int, scale: float = 0.08) -> None:
        self.w.add_tensor(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32))

    def array(self, name: str, values: np.ndarray) -> None:
        self.w.add_tensor(name, values.astype(np.float32))


# Control tokens a family's vocabulary must hold for llama.cpp to load it (its vocabulary
# loader looks them up by text), after the byte tokens.
EXTRA_TOKENS = {"phi3": ("<|endoftext|>",)}


# Qwen's fill-in-the-middle tokens, which llama.cpp finds by their text.
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def n_vocab(arch: str, fim: bool = False) -> int:
    return N_VOCAB + len(EXTRA_TOKENS.get(arch, ())) + (len(FIM_TOKENS) if fim else 0)


def _add_vocab(w: gguf.GGUFWriter, extra: Sequence[str] = ()) -> None:
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + list(extra)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [6] * 256 + [3] * len(extra))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Mixture-of-experts families: every layer's FFN is `N_EXPERTS` experts, `N_EXPERTS_USED` of
# them chosen per token by a router (qwen2moe adds a shared expert, gated per token).
MOE = frozenset({"qwen2moe", "qwen3moe"})
N_EXPERTS, N_EXPERTS_USED = 4, 2


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
    experts: bool = False,
    fim: bool = False,
) -> Path:
    """`experts`: a `llama` whose FFNs are experts (Mixtral); the MoE families always are.
    `fim`: the vocabulary holds fill-in-the-middle tokens (`FIM_TOKENS`)."""
    head_dim = n_embd // n_head
    experts = experts or arch in MOE
    w = _begin(path, arch, n_embd=n_embd, n_layers=n_layers)
    w.add_feed_forward_length(n_ff)
    # Mixtral's experts are as wide as its feed_forward_length; the MoE families name theirs.
    n_ff_exp = n_ff // 2 if arch in MOE else n_ff
    if experts:
        w.add_expert_count(N_EXPERTS)
        w.add_expert_used_count(N_EXPERTS_USED)
    if arch in MOE:
        w.add_expert_feed_forward_length(n_ff_exp)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(n_ff)
    _attention_hparams(w, n_head, n_head_kv, head_dim, head_dim)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
    _add_vocab(w, EXTRA_TOKENS.get(arch, ()) + (FIM_TOKENS if fim else ()))
    g = _Weights(w, seed)
    _embeddings_and_head(g, n_embd, n_vocab(arch, fim))
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        if arch == "phi3":
            # Phi-3 and Phi-4: one fused Q/K/V projection and one fused gate/up projection
            # (SwiGLU over its two halves).
            g.normal(p + "attn_qkv.weight", (n_head + 2 * n_head_kv) * head_dim, n_embd)
            g.normal(p + "attn_output.weight", n_embd, n_head * head_dim)
            g.ones(p + "ffn_norm.weight", n_embd)
            g.normal(p + "ffn_up.weight", 2 * n_ff, n_embd)
            g.normal(p + "ffn_down.weight", n_embd, n_ff)
            continue
        _attention(g, p, n_embd, n_head, n_head_kv)
        if arch == "qwen2":
            g.normal(p + "attn_q.bias", n_head * head_dim, scale=0.05)
            g.normal(p + "attn_k.bias", n_head_kv * head_dim, scale=0.05)
            g.normal(p + "attn_v.bias", n_head_kv * head_dim, scale=0.05)
        if arch in ("qwen3", "qwen3moe"):
            g.ones(p + "attn_q_norm.weight", head_dim)
            g.ones(p + "attn_k_norm.weight", head_dim)
        if arch == "qwen2moe":
            g.normal(p + "attn_q.bias", n_head * head_dim, scale=0.05)
            g.normal(p + "attn_k.bias", n_head_kv * head_dim, scale=0.05)
            g.normal(p + "attn_v.bias", n_head_kv * head_dim, scale=0.05)
        if experts:
            _moe_ffn(g, p, n_embd, n_ff_exp, shared=n_ff if arch == "qwen2moe" else 0)
        else:
            _dense_ffn(g, p, n_embd, n_ff)
    return _finish(w, path)


def _attention_hparams(
    w: gguf.GGUFWriter, n_head: int, n_head_kv: int, key_length: int, value_length: int
) -> None:
    """Heads, their widths, RoPE base, norm epsilon and f32 weights, as the attention
    families have them."""
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(key_length)
    w.add_value_length(value_length)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _begin(path: Path, arch: str, *, n_embd: int, n_layers: int) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layers)
    return w


def _embeddings_and_head(g: _Weights, n_embd: int, vocab: int = N_VOCAB) -> None:
    g.normal("token_embd.weight", vocab, n_embd, scale=0.5)
    g.ones("output_norm.weight", n_embd)
    g.normal("output.weight", vocab, n_embd, scale=0.2)


def _attention(
    g: _Weights, p: str, n_embd: int, n_head: int, n_head_kv: int, scale: float = 0.08
) -> None:
    head_dim = n_embd // n_head
    g.normal(p + "attn_q.weight", n_head * head_dim, n_embd, scale=scale)
    g.normal(p + "attn_k.weight", n_head_kv * head_dim, n_embd, scale=scale)
    g.normal(p + "attn_v.weight", n_head_kv * head_dim, n_embd, scale=scale)
    g.normal(p + "attn_output.weight", n_embd, n_head * head_dim, scale=scale)


def _dense_ffn(g: _Weights, p: str, n_embd: int, n_ff: int) -> None:
    g.ones(p + "ffn_norm.weight", n_embd)
    g.normal(p + "ffn_gate.weight", n_ff, n_embd)
    g.normal(p + "ffn_up.weight", n_ff, n_embd)
    g.normal(p + "ffn_down.weight", n_embd, n_ff)


def _moe_ffn(g: _Weights, p: str, n_embd: int, n_ff_exp: int, *, shared: int) -> None:
    """A router over `N_EXPERTS` SwiGLU experts (stacked: numpy order is ggml's reversed), and
    where `shared`, a shared expert of that width with its per-token gate."""
    g.ones(p + "ffn_norm.weight", n_embd)
    g.normal(p + "ffn_gate_inp.weight", N_EXPERTS, n_embd, scale=0.5)
    g.normal(p + "ffn_gate_exps.weight", N_EXPERTS, n_ff_exp, n_embd)
    g.normal(p + "ffn_up_exps.weight", N_EXPERTS, n_ff_exp, n_embd)
    g.normal(p + "ffn_down_exps.weight", N_EXPERTS, n_embd, n_ff_exp)
    if shared:
        g.normal(p + "ffn_gate_inp_shexp.weight", n_embd)
        g.normal(p + "ffn_gate_shexp.weight", shared, n_embd)
        g.normal(p + "ffn_up_shexp.weight", shared, n_embd)
        g.normal(p + "ffn_down_shexp.weight", n_embd, shared)


def write_tiny_deepseek2(
    path: Path,
    *,
    n_layers: int = 6,
    dense_lead: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    seed: int = 0,
) -> Path:
    """A DeepSeek-V2/V3-shaped model: multi-head latent attention (queries and keys/values
    through low-rank projections, a decoupled RoPE part) and, past `dense_lead` dense layers
    chosen by absolute layer index, routed experts plus a shared expert."""
    q_rank, kv_rank, rope, nope, v_dim = 32, 16, 8, 8, 16
    w = _begin(path, "deepseek2", n_embd=n_embd, n_layers=n_layers)
    w.add_feed_forward_length(n_ff)
    _attention_hparams(w, n_head, n_head, nope + rope, v_dim)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(dense_lead)
    w.add_q_lora_rank(q_rank)
    w.add_kv_lora_rank(kv_rank)
    w.add_expert_count(N_EXPERTS)
    w.add_expert_used_count(N_EXPERTS_USED)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(n_ff // 2)
    w.add_expert_weights_scale(1.0)
    _add_vocab(w)
    g = _Weights(w, seed)
    _embeddings_and_head(g, n_embd)
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        g.normal(p + "attn_q_a.weight", q_rank, n_embd)
        g.ones(p + "attn_q_a_norm.weight", q_rank)
        g.normal(p + "attn_q_b.weight", n_head * (nope + rope), q_rank)
        g.normal(p + "attn_kv_a_mqa.weight", kv_rank + rope, n_embd)
        g.ones(p + "attn_kv_a_norm.weight", kv_rank)
        g.normal(p + "attn_kv_b.weight", n_head * (nope + v_dim), kv_rank)
        g.normal(p + "attn_output.weight", n_embd, n_head * v_dim)
        if i < dense_lead:
            _dense_ffn(g, p, n_embd, n_ff)
            continue
        g.ones(p + "ffn_norm.weight", n_embd)
        g.normal(p + "ffn_gate_inp.weight", N_EXPERTS, n_embd, scale=0.5)
        for kind in ("gate", "up"):
            g.normal(p + f"ffn_{kind}_exps.weight", N_EXPERTS, n_ff // 2, n_embd)
            g.normal(p + f"ffn_{kind}_shexp.weight", n_ff // 2, n_embd)
        g.normal(p + "ffn_down_exps.weight", N_EXPERTS, n_embd, n_ff // 2)
        g.normal(p + "ffn_down_shexp.weight", n_embd, n_ff // 2)
    return _finish(w, path)


def _add_window(w: gguf.GGUFWriter, arch: str, window: int, pattern: int | Sequence[bool] | None):
    """The sliding window and, where given, the model's own pattern (one number n: layer i
    windowed when i % n < n - 1; or a flag per layer)."""
    w.add_sliding_window(window)
    if pattern is None:
        return
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(pattern, int):
        w.add_uint32(key, pattern)
    else:
        w.add_array(key, [bool(f) for f in pattern])


GEMMA = ("gemma", "gemma2", "gemma3")
# Attention weights larger, and embeddings smaller, than the other families': scaled by
# sqrt(n_embd), the embeddings would otherwise drown the layers' output, and the tied head
# would answer each token with itself.
ATTN_SCALE = 0.3
EMB_SCALE = 0.05


def write_tiny_gemma(
    path: Path,
    arch: str,
    *,
    n_layers: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    sliding_window: int = 32,
    swa_pattern: int | Sequence[bool] | None = None,
    seed: int = 0,
) -> Path:
    """A Gemma 1, 2 or 3: input embeddings scaled by sqrt(n_embd) inside the graph, the output
    head tied to them, and (2 and 3) norms after attention and FFN, sliding-window layers
    alternating with global ones by layer index (`swa_pattern`: one number n, layer i windowed
    when i % n < n - 1, or a flag per layer; absent, the family's own), softcapped logits (2)
    and normed queries and keys (3)."""
    if arch not in GEMMA:
        raise ValueError(f"not a Gemma: {arch}")
    head_dim = n_embd // n_head
    w = _begin(path, arch, n_embd=n_embd, n_layers=n_layers)
    w.add_feed_forward_length(n_ff)
    _attention_hparams(w, n_head, n_head_kv, head_dim, head_dim)
    if arch != "gemma":
        _add_window(w, arch, sliding_window, swa_pattern)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", 50.0)
        w.add_float32(f"{arch}.final_logit_softcapping", 30.0)
    if arch == "gemma3":
        w.add_float32(f"{arch}.rope.freq_base_swa", 1000.0)
    _add_vocab(w)
    g = _Weights(w, seed)
    g.normal("token_embd.weight", N_VOCAB, n_embd, scale=EMB_SCALE)
    g.ones("output_norm.weight", n_embd)
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        _attention(g, p, n_embd, n_head, n_head_kv, scale=ATTN_SCALE)
        if arch != "gemma":
            g.ones(p + "post_attention_norm.weight", n_embd)
            g.ones(p + "post_ffw_norm.weight", n_embd)
        if arch == "gemma3":
            g.ones(p + "attn_q_norm.weight", head_dim)
            g.ones(p + "attn_k_norm.weight", head_dim)
        _dense_ffn(g, p, n_embd, n_ff)
    return _finish(w, path)


def write_tiny_cohere2(
    path: Path,
    *,
    n_layers: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    sliding_window: int = 32,
    swa_pattern: int | Sequence[bool] | None = None,
    seed: int = 0,
) -> Path:
    """A Cohere 2 (Command R7B): layer norms without bias, attention and FFN in parallel from
    one norm, the output head tied to the token embeddings and its logits scaled, and
    sliding-window layers alternating with global ones by layer index (`swa_pattern` as for
    `write_tiny_gemma`; absent, the family's own: three windowed layers, then a global one).
    Only the windowed layers apply RoPE; the global ones attend without positions."""
    arch = "cohere2"
    head_dim = n_embd // n_head
    w = _begin(path, arch, n_embd=n_embd, n_layers=n_layers)
    w.add_feed_forward_length(n_ff)
    _attention_hparams(w, n_head, n_head_kv, head_dim, head_dim)
    w.add_layer_norm_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_logit_scale(0.25)
    _add_window(w, arch, sliding_window, swa_pattern)
    w.add_vocab_size(N_VOCAB)
    _add_vocab(w)
    g = _Weights(w, seed)
    # Embeddings small beside the layers' output, as for Gemma: the residual keeps its input
    # embedding, and the tied head would otherwise answer each token with itself.
    g.normal("token_embd.weight", N_VOCAB, n_embd, scale=EMB_SCALE)
    g.ones("output_norm.weight", n_embd)
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        _attention(g, p, n_embd, n_head, n_head_kv, scale=ATTN_SCALE)
        g.normal(p + "ffn_gate.weight", n_ff, n_embd)
        g.normal(p + "ffn_up.weight", n_ff, n_embd)
        g.normal(p + "ffn_down.weight", n_embd, n_ff)
    return _finish(w, path)


def write_tiny_gpt_oss(
    path: Path,
    *,
    n_layers: int = 6,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 32,
    n_ff_exp: int = 64,
    sliding_window: int = 32,
    swa_pattern: int | Sequence[bool] | None = None,
    ff_exp_per_layer: bool = False,
    seed: int = 0,
) -> Path:
    """A gpt-oss (llama.cpp's OpenAI MoE): query heads wider together (n_head * head_dim)
    than the embedding, biased Q/K/V and output projections, a learned attention sink per
    head, YaRN RoPE on every layer, a norm after attention, and an FFN of routed experts only
    (softmax over the chosen experts' router logits, biased router and experts, the clamped
    SwiGLU of gpt-oss); sliding-window layers alternate with global ones by layer index
    (`swa_pattern` as for `write_tiny_gemma`; absent, the family's own: even layers
    windowed). `ff_exp_per_layer`: the experts' width as one value per layer, which llama.cpp
    also reads."""
    arch = "gpt-oss"
    w = _begin(path, arch, n_embd=n_embd, n_layers=n_layers)
    _attention_hparams(w, n_head, n_head_kv, head_dim, head_dim)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_expert_count(N_EXPERTS)
    w.add_expert_used_count(N_EXPERTS_USED)
    if ff_exp_per_layer:
        w.add_array(f"{arch}.expert_feed_forward_length", [n_ff_exp] * n_layers)
    else:
        w.add_expert_feed_forward_length(n_ff_exp)
    _add_window(w, arch, sliding_window, swa_pattern)
    _add_vocab(w)
    g = _Weights(w, seed)
    _embeddings_and_head(g, n_embd)
    q, kv = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        g.normal(p + "attn_q.weight", q, n_embd, scale=ATTN_SCALE)
        g.normal(p + "attn_k.weight", kv, n_embd, scale=ATTN_SCALE)
        g.normal(p + "attn_v.weight", kv, n_embd, scale=ATTN_SCALE)
        g.normal(p + "attn_q.bias", q, scale=0.05)
        g.normal(p + "attn_k.bias", kv, scale=0.05)
        g.normal(p + "attn_v.bias", kv, scale=0.05)
        g.normal(p + "attn_output.weight", n_embd, q, scale=ATTN_SCALE)
        g.normal(p + "attn_output.bias", n_embd, scale=0.05)
        g.normal(p + "attn_sinks.weight", n_head, scale=1.0)
        g.ones(p + "post_attention_norm.weight", n_embd)
        g.normal(p + "ffn_gate_inp.weight", N_EXPERTS, n_embd, scale=0.5)
        g.normal(p + "ffn_gate_inp.bias", N_EXPERTS, scale=0.1)
        for kind in ("gate", "up"):
            g.normal(p + f"ffn_{kind}_exps.weight", N_EXPERTS, n_ff_exp, n_embd, scale=0.3)
            g.normal(p + f"ffn_{kind}_exps.bias", N_EXPERTS, n_ff_exp, scale=0.1)
        g.normal(p + "ffn_down_exps.weight", N_EXPERTS, n_embd, n_ff_exp, scale=0.3)
        g.normal(p + "ffn_down_exps.bias", N_EXPERTS, n_embd, scale=0.1)
    return _finish(w, path)


def _mamba_block(
    g: _Weights, p: str, *, n_embd: int, d_conv: int, d_state: int, dt_rank: int, norms: bool
) -> None:
    """One Mamba(1) mixer, shapes as llama.cpp loads them (numpy order is ggml's reversed).
    llama.cpp supports only d_inner = 2 * n_embd."""
    d_inner = 2 * n_embd
    g.normal(p + "ssm_in.weight", 2 * d_inner, n_embd)
    g.normal(p + "ssm_conv1d.weight", d_inner, d_conv, scale=0.3)
    g.normal(p + "ssm_conv1d.bias", d_inner, scale=0.05)
    g.normal(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
    g.normal(p + "ssm_dt.weight", d_inner, dt_rank, scale=0.3)
    g.normal(p + "ssm_dt.bias", d_inner, scale=0.1)
    # A = -exp(A_log) as the converter stores it: negative, so the state decays.
    a_log = np.log(np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)))
    g.array(p + "ssm_a", -np.exp(a_log + 0.1 * g.rng.standard_normal(a_log.shape)))
    g.ones(p + "ssm_d", d_inner)
    g.normal(p + "ssm_out.weight", n_embd, d_inner)
    if norms:
        g.ones(p + "ssm_dt_norm.weight", dt_rank)
        g.ones(p + "ssm_b_norm.weight", d_state)
        g.ones(p + "ssm_c_norm.weight", d_state)


def _add_ssm_hparams(w: gguf.GGUFWriter, n_embd: int, d_conv: int, d_state: int, dt_rank: int):
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(2 * n_embd)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)


def write_tiny_mamba(
    path: Path,
    *,
    n_layers: int = 6,
    n_embd: int = 64,
    d_conv: int = 4,
    d_state: int = 16,
    dt_rank: int = 8,
    seed: int = 0,
) -> Path:
    """A Mamba(1) model: every layer is a state-space mixer, no attention, no FFN."""
    w = _begin(path, "mamba", n_embd=n_embd, n_layers=n_layers)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    _add_ssm_hparams(w, n_embd, d_conv, d_state, dt_rank)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w)
    g = _Weights(w, seed)
    _embeddings_and_head(g, n_embd)
    for i in range(n_layers):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        _mamba_block(
            g, p, n_embd=n_embd, d_conv=d_conv, d_state=d_state, dt_rank=dt_rank, norms=False
        )
    return _finish(w, path)


def write_tiny_jamba(
    path: Path,
    *,
    layer_types: Sequence[str] = JAMBA_PATTERN,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    d_conv: int = 4,
    d_state: int = 16,
    dt_rank: int = 8,
    seed: int = 0,
) -> Path:
    """A Jamba model: attention (no RoPE) or Mamba mixer per `layer_types`, each followed by a
    dense SwiGLU FFN (real Jamba models put experts on every other layer; not needed here)."""
    w = _begin(path, "jamba", n_embd=n_embd, n_layers=len(layer_types))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([n_head_kv if t == "attention" else 0 for t in layer_types])
    w.add_layer_norm_rms_eps(1e-6)
    _add_ssm_hparams(w, n_embd, d_conv, d_state, dt_rank)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w)
    g = _Weights(w, seed)
    _embeddings_and_head(g, n_embd)
    for i, kind in enumerate(layer_types):
        p = f"blk.{i}."
        g.ones(p + "attn_norm.weight", n_embd)
        if kind == "attention":
            _attention(g, p, n_embd, n_head, n_head_kv)
        else:
            _mamba_block(
                g, p, n_embd=n_embd, d_conv=d_conv, d_state=d_state, dt_rank=dt_rank, norms=True
            )
        _dense_ffn(g, p, n_embd, n_ff)
    return _finish(w, path)


def quantize(src: Path, dst: Path, ftype: int) -> Path:
    """`src` quantized by llama.cpp itself (`ftype`: a `llama_cpp.LLAMA_FTYPE_*`)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)):
        raise RuntimeError(f"llama.cpp could not quantize {src}")
    return dst


# One tiny model of each family the stage engine runs, by the name the docs' family table uses
# (docs/engine.md): what the parity, certification and end-to-end tests iterate over.
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama": lambda p: write_tiny_model(p, "llama"),
    "qwen2": lambda p: write_tiny_model(p, "qwen2"),
    "qwen3": lambda p: write_tiny_model(p, "qwen3"),
    "phi3": lambda p: write_tiny_model(p, "phi3"),
    "mixtral": lambda p: write_tiny_model(p, "llama", experts=True),
    "qwen2moe": lambda p: write_tiny_model(p, "qwen2moe"),
    "qwen3moe": lambda p: write_tiny_model(p, "qwen3moe"),
    "deepseek2": lambda p: write_tiny_deepseek2(p),
    "gemma": lambda p: write_tiny_gemma(p, "gemma"),
    "gemma2": lambda p: write_tiny_gemma(p, "gemma2"),
    "gemma3": lambda p: write_tiny_gemma(p, "gemma3"),
    "cohere2": lambda p: write_tiny_cohere2(p),
    "gpt-oss": lambda p: write_tiny_gpt_oss(p),
    "mamba": lambda p: write_tiny_mamba(p),
    "jamba": lambda p: write_tiny_jamba(p),
}
