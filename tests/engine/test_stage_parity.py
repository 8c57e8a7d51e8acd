"""A model split into stages computes exactly what llama.cpp computes on the whole model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.split_in_process import StagedEngine
from meshagent.errors import ModelError
from meshagent.models.architectures import stage_refusal
from meshagent.testing.tiny_gguf import (
    write_tiny_cohere2,
    write_tiny_deepseek2,
    write_tiny_gemma,
    write_tiny_gpt_oss,
    write_tiny_model,
)

PROMPT = (
    "The keeper of the northern lighthouse kept a log of every ship that passed, "
    "every storm that broke against the rocks and every letter that arrived by boat. "
) * 8

# f16 activations round the residual stream between stages; SmolLM2's residual reaches about
# 22,000 after layer 20, where f16 steps are 16 apart. Measured (3 stages, 200-token prompt +
# 64 greedy steps): max |logit diff| 1.13, mean 0.17. A wrong layer, position or row order
# gives mean differences of several units.
F16_MAX_LOGIT_DIFF = 2.0
F16_MEAN_LOGIT_DIFF = 0.5
# Layers each engine offloads to GPUs: bench/device_check.sh runs these tests with every layer
# on the GPU (99), whole model and stages alike; a CPU build offloads none, whatever it says.
GPU_LAYERS = int(os.environ.get("MESHAGENT_TEST_GPU_LAYERS", "0"))


def greedy_run(engine, prompt_tokens: list[int], steps: int):
    """Prefill, then `steps` greedy tokens; returns (all logits, generated tokens)."""
    engine.clear_sequence(0)
    logits = [engine.forward([ForwardItem(0, 0, prompt_tokens, True)])[0]]
    tokens = []
    pos = len(prompt_tokens)
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(engine.forward([ForwardItem(0, pos, [tokens[-1]], True)])[0])
        pos += 1
    return logits, tokens


@pytest.fixture(scope="module")
def smollm_whole(model_path: Path):
    eng = LlamaEngine(model_path, slots=2, slot_ctx=1024, flash_attn=False, gpu_layers=GPU_LAYERS)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def smollm_prompt(smollm_whole) -> list[int]:
    tokens = smollm_whole.tokenize(PROMPT, add_bos=True)[:200]
    assert len(tokens) == 200
    return tokens


@pytest.fixture(scope="module")
def smollm_reference(smollm_whole, smollm_prompt):
    return greedy_run(smollm_whole, smollm_prompt, 64)


def test_smollm_three_stages_f32_is_exact(model_path, store, smollm_prompt, smollm_reference):
    staged = StagedEngine(
        model_path, [0, 10, 20, 30], store, slots=2, slot_ctx=1024, gpu_layers=GPU_LAYERS
    )
    try:
        logits, tokens = greedy_run(staged, smollm_prompt, 64)
    finally:
        staged.close()
    ref_logits, ref_tokens = smollm_reference
    assert tokens == ref_tokens
    for ours, theirs in zip(logits, ref_logits, strict=True):
        assert np.array_equal(ours, theirs)


def test_smollm_three_stages_f16_keeps_greedy_tokens(
    model_path, store, smollm_prompt, smollm_reference
):
    staged = StagedEngine(
        model_path,
        [0, 10, 20, 30],
        store,
        slots=2,
        slot_ctx=1024,
        wire_dtype="f16",
        gpu_layers=GPU_LAYERS,
    )
    try:
        logits, tokens = greedy_run(staged, smollm_prompt, 64)
    finally:
        staged.close()
    ref_logits, ref_tokens = smollm_reference
    assert tokens == ref_tokens
    diffs = [np.abs(a - b) for a, b in zip(logits, ref_logits, strict=True)]
    worst = max(float(d.max()) for d in diffs)
    mean = float(np.mean([d.mean() for d in diffs]))
    print(f"f16 wire: max |logit diff| {worst:.3f}, mean {mean:.4f}")
    assert worst < F16_MAX_LOGIT_DIFF
    assert mean < F16_MEAN_LOGIT_DIFF
    assert worst > 0  # f16 really was on the wire


def chunked_run(engine, prompt: list[int], chunks: tuple[int, ...], steps: int):
    """The prompt prefilled in `chunks` then the rest, then `steps` greedy tokens; the logits
    after the prompt and after each step."""
    engine.clear_sequence(0)
    pos = 0
    for n in (*chunks, len(prompt) - sum(chunks)):
        logits = engine.forward([ForwardItem(0, pos, prompt[pos : pos + n], True)])[0]
        pos += n
    out = [logits]
    for _ in range(steps):
        out.append(engine.forward([ForwardItem(0, pos, [int(np.argmax(out[-1]))], True)])[0])
        pos += 1
    return out


def pair_run(engine, prompts: list[list[int]], steps: int):
    """Two sequences prefilled in one call, then decoded together for `steps` greedy steps
    (in the other order every second step); each one's logits."""
    for s in (0, 1):
        engine.clear_sequence(s)
    first = engine.forward([ForwardItem(s, 0, p, True) for s, p in enumerate(prompts)])
    got = [[lg] for lg in first]
    pos = [len(p) for p in prompts]
    for step in range(steps):
        order = [0, 1] if step % 2 == 0 else [1, 0]
        items = [ForwardItem(s, pos[s], [int(np.argmax(got[s][-1]))], True) for s in order]
        for s, lg in zip(order, engine.forward(items), strict=True):
            got[s].append(lg)
            pos[s] += 1
    return got


def assert_splits_exactly(path, cuts, store) -> None:
    """The model at `path` cut at `cuts` gives the whole model's logits, bit for bit: on a
    200-token prompt and 32 greedy steps, on the same prompt prefilled in three calls, and
    on two sequences of different lengths prefilled in one call and decoded together."""
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 259, 200)]
    other = [int(t) for t in rng.integers(3, 259, 77)]
    whole = LlamaEngine(path, slots=2, slot_ctx=512, flash_attn=False, gpu_layers=GPU_LAYERS)
    staged = StagedEngine(path, cuts, store, slots=2, slot_ctx=512, gpu_layers=GPU_LAYERS)
    try:
        ref_logits, ref_tokens = greedy_run(whole, prompt, 32)
        logits, tokens = greedy_run(staged, prompt, 32)
        chunked = chunked_run(staged, prompt, (37, 81), 8)
        ref_pair, pair = (pair_run(e, [prompt[:120], other], 8) for e in (whole, staged))
    finally:
        whole.close()
        staged.close()
    assert tokens == ref_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, ref_logits, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(chunked, ref_logits[:9], strict=True))
    for ours, theirs in zip(pair, ref_pair, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # A random model is not degenerate: its greedy tokens vary.
    assert len(set(tokens)) > 3


@pytest.mark.parametrize(
    "arch, window, experts",
    [
        ("llama", None, False),
        ("qwen2", None, False),
        ("qwen3", None, False),
        ("phi3", None, False),
        ("phi3", 64, False),
        ("llama", None, True),  # Mixtral
        ("qwen2moe", None, True),
        ("qwen3moe", None, True),
    ],
)
def test_tiny_models_split_exactly(arch, window, experts, tmp_path, store):
    # Phi-3 (and Phi-4): fused projections, and a sliding window in the metadata of some
    # models that llama.cpp does not apply by layer index (a 200-token prompt crosses it).
    # Experts: 2 of 4 per token, routed in each stage as in the whole model.
    path = write_tiny_model(
        tmp_path / f"tiny-{arch}.gguf", arch, n_layers=6, sliding_window=window, experts=experts
    )
    for cuts in ([0, 3, 6], [0, 2, 4, 6]):
        assert_splits_exactly(path, cuts, store)


@pytest.mark.parametrize("lead, cuts", [(3, [0, 2, 4, 6]), (2, [0, 2, 4, 6]), (1, [0, 3, 6])])
def test_deepseek2_splits_exactly_with_its_dense_layers_counted_per_slice(
    lead, cuts, tmp_path, store
):
    # Multi-head latent attention; the first `lead` layers dense, the rest routed experts and a
    # shared one. Each slice says how many of its own leading layers are dense: a cut inside
    # the dense layers, at their end, and past it.
    path = write_tiny_deepseek2(tmp_path / "tiny-deepseek2.gguf", dense_lead=lead)
    assert_splits_exactly(path, cuts, store)


@pytest.mark.parametrize(
    "arch, pattern, cuts",
    [
        ("gemma", None, [0, 2, 4, 6]),
        ("gemma", None, [0, 3, 6]),
        # Gemma 2: layers alternate windowed (even) and global (odd); a slice from an odd
        # layer starts with a global one.
        ("gemma2", None, [0, 1, 4, 6]),
        ("gemma2", None, [0, 3, 6]),
        # Gemma 3: five windowed layers, then a global one; the last slice ends with it.
        ("gemma3", None, [0, 3, 6]),
        ("gemma3", 3, [0, 2, 4, 6]),  # the model's own pattern number
        # A flag per layer. The slice [1, 3) has no windowed layer, which llama.cpp refuses
        # (it aborts): the slicer pads it with a zeroed windowed layer.
        ("gemma3", [True, False, False, True, True, False], [0, 1, 3, 6]),
        ("gemma2", [True, False, False, True, True, False], [0, 1, 3, 6]),
    ],
)
def test_gemma_splits_exactly(arch, pattern, cuts, tmp_path, store):
    # The input scaled by sqrt(n_embd): Gemma 3's entry scales token embeddings (llama.cpp
    # scales only token ids); Gemma 1 and 2's later stages restore their unscaled input. Each
    # slice carries its layers' window flags; the 200-token prompt crosses the 32-token window.
    path = write_tiny_gemma(tmp_path / f"tiny-{arch}.gguf", arch, swa_pattern=pattern)
    assert_splits_exactly(path, cuts, store)


# A layer pattern of Gemma 2's kind: layer 0 windowed, layers 1 and 2 global, layers 3 and 4
# windowed, layer 5 global (the slice [1, 3) is global only, and needs the padding layer).
MIXED_PATTERN = [True, False, False, True, True, False]


@pytest.mark.parametrize(
    "pattern, cuts",
    [
        # The family's own pattern: layers 0-2 windowed, 3 global, 4-5 windowed. Windowed
        # only; global only, from a global layer (padded with a windowed one); windowed only.
        (None, [0, 3, 4, 6]),
        (None, [0, 2, 5, 6]),  # a slice across both boundaries, windowed at either end
        (None, [0, 4, 6]),  # two stages: the global layer ends the first
        (3, [0, 2, 4, 6]),  # the model's own pattern number: [2, 4) starts at a global layer
        (MIXED_PATTERN, [0, 1, 3, 6]),  # a flag per layer
    ],
)
def test_cohere2_splits_exactly(pattern, cuts, tmp_path, store):
    # Command R7B: only the windowed layers apply RoPE, so a slice given the wrong flags
    # would not only widen or narrow the window but rotate the wrong layers. The 200-token
    # prompt crosses the 32-token window.
    path = write_tiny_cohere2(tmp_path / "tiny-cohere2.gguf", swa_pattern=pattern)
    assert_splits_exactly(path, cuts, store)


@pytest.mark.parametrize(
    "pattern, cuts, ff_exp_per_layer",
    [
        # The family's own pattern: even layers windowed. Windowed only, global only, and a
        # mixed slice from a windowed layer.
        (None, [0, 1, 2, 6], False),
        (None, [0, 3, 6], False),  # [3, 6) starts at a global layer
        (MIXED_PATTERN, [0, 1, 3, 6], False),  # a flag per layer
        (None, [0, 2, 4, 6], True),  # the experts' width as one value per layer, cut
    ],
)
def test_gpt_oss_splits_exactly(pattern, cuts, ff_exp_per_layer, tmp_path, store):
    # Attention sinks, a biased router and biased experts, the clamped SwiGLU, YaRN RoPE;
    # the 200-token prompt crosses the 32-token window.
    path = write_tiny_gpt_oss(
        tmp_path / "tiny-gpt-oss.gguf", swa_pattern=pattern, ff_exp_per_layer=ff_exp_per_layer
    )
    assert_splits_exactly(path, cuts, store)


def test_gemma_27b_is_refused_for_its_attention_scale():
    # llama.cpp picks the 27B's attention scale (n_embd / n_head, not the head width) by its
    # layer count; a slice has fewer layers.
    keys = {"gemma3.attention.sliding_window"}
    shape = {"n_embd": 5376, "n_head": 32, "head_dim": 128}
    assert "layer count" in stage_refusal("gemma3", keys, n_layers=62, **shape)
    assert "layer count" in stage_refusal(
        "gemma2", set(), n_layers=46, n_embd=4608, n_head=32, head_dim=128
    )
    assert stage_refusal("gemma3", keys, n_layers=34, n_embd=2560, n_head=8, head_dim=256) is None
    # Where both scales agree the layer count does not matter.
    assert stage_refusal("gemma3", keys, n_layers=62, n_embd=4096, n_head=32, head_dim=128) is None


def test_split_refused_for_index_dependent_architectures(tmp_path, store):
    path = write_tiny_model(tmp_path / "tiny-swa.gguf", "qwen2", n_layers=4, sliding_window=64)
    with pytest.raises(ModelError, match="sliding-window"):
        StagedEngine(path, [0, 2, 4], store, slots=1, slot_ctx=256)


def test_interleaved_sequences_match_each_alone(model_path, store, smollm_whole):
    """Four sequences decoded together, in a different order every step (llama.cpp builds
    micro-batches from runs of consecutive sequence ids), give each one's lone tokens."""
    staged = StagedEngine(
        model_path, [0, 10, 20, 30], store, slots=4, slot_ctx=512, gpu_layers=GPU_LAYERS
    )
    prompts = [
        smollm_whole.tokenize(p, add_bos=True)
        for p in ("The capital of France is", "Once upon a time", "def fibonacci(n):", "Hi")
    ]
    orders = [[0, 1, 2, 3], [2, 1, 0, 3], [3, 0, 2, 1], [1, 3, 0, 2]]
    try:
        alone = [greedy_run(staged, p, 16)[1] for p in prompts]
        for s in range(4):
            staged.clear_sequence(s)
        logits = staged.forward([ForwardItem(s, 0, p, True) for s, p in enumerate(prompts)])
        pos = [len(p) for p in prompts]
        together: list[list[int]] = [[] for _ in prompts]
        for step in range(16):
            nxt = [int(np.argmax(lg)) for lg in logits]
            for s in range(4):
                together[s].append(nxt[s])
            order = orders[step % len(orders)]
            out = staged.forward([ForwardItem(s, pos[s], [nxt[s]], True) for s in order])
            logits = [out[order.index(s)] for s in range(4)]
            pos = [p + 1 for p in pos]
    finally:
        staged.close()
    assert together == alone


def test_trim_rewinds_a_sequence_exactly(model_path, store, smollm_prompt):
    staged = StagedEngine(model_path, [0, 10, 20, 30], store, slots=1, slot_ctx=1024)
    pos = len(smollm_prompt)
    try:
        prefill = staged.forward([ForwardItem(0, 0, smollm_prompt, True)])[0]
        token = int(np.argmax(prefill))
        step = staged.forward([ForwardItem(0, pos, [token], True)])[0]
        # Rewind, feed 8 wrong tokens, rewind again: the step is as if they never were.
        staged.trim_sequence(0, pos)
        staged.forward([ForwardItem(0, pos, [7] * 8, True)])
        staged.trim_sequence(0, pos)
        assert np.array_equal(staged.forward([ForwardItem(0, pos, [token], True)])[0], step)
        staged.reset()
        assert np.array_equal(staged.forward([ForwardItem(0, 0, smollm_prompt, True)])[0], prefill)
    finally:
        staged.close()
