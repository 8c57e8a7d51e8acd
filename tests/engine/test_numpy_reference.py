"""The numpy engine agrees with llama.cpp within rounding: an independent oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.runtime import EmbdItem
from meshagent.models.slicer import TokenEmbeddings
from meshagent.testing.numpy_ref import NumpyStage
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.engine.test_stage_parity import PROMPT


def teacher_forced_top1(llama: LlamaEngine, model_path, tokens: list[int], split: list[int]):
    """Feed `tokens` one by one to llama.cpp and at once through numpy stages; return the
    per-position argmax of both."""
    llama.clear_sequence(0)
    ours = [
        int(np.argmax(llama.forward([ForwardItem(0, i, [t], True)])[0]))
        for i, t in enumerate(tokens)
    ]
    embed = TokenEmbeddings(model_path)
    x = embed(tokens)
    stages = [NumpyStage(model_path, start=a, end=b) for a, b in itertools.pairwise(split)]
    for st in stages[:-1]:
        x = st.forward([EmbdItem(0, 0, x)]).hidden[0]
    logits = stages[-1].forward([EmbdItem(0, 0, x, True)], all_logits=True).logits[0]
    return ours, [int(i) for i in np.argmax(logits, axis=-1)]


def test_smollm_top1_agreement(model_path):
    llama = LlamaEngine(model_path, slots=1, slot_ctx=512, flash_attn=False)
    try:
        tokens = llama.tokenize(PROMPT, add_bos=True)[:200]
        ref, got = teacher_forced_top1(llama, model_path, tokens, [0, 10, 20, 30])
    finally:
        llama.close()
    agreement = np.mean(np.asarray(ref) == np.asarray(got))
    print(f"numpy vs llama.cpp top-1 agreement: {agreement:.3f} over {len(tokens)} steps")
    assert agreement >= 0.90


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_agree(arch, tmp_path):
    path = write_tiny_model(tmp_path / f"tiny-{arch}.gguf", arch, n_layers=4)
    llama = LlamaEngine(path, slots=1, slot_ctx=256, flash_attn=False)
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, 259, 64)]
    try:
        ref, got = teacher_forced_top1(llama, path, tokens, [0, 2, 4])
    finally:
        llama.close()
    assert np.mean(np.asarray(ref) == np.asarray(got)) >= 0.95
