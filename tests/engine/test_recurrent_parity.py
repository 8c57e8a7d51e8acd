"""Recurrent and hybrid families split into stages compute exactly what llama.cpp computes on
the whole model: a pure state-space model (mamba) and a hybrid of attention and Mamba layers
(jamba, pattern R A R R A A), f32 activations between stages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.split_in_process import StagedEngine
from meshagent.errors import EngineError, ModelError
from meshagent.models.family import family_traits
from meshagent.models.layout import inspect_model, open_gguf
from meshagent.models.slicer import PAD_LAYERS_KEY, SLICE_KEY_PREFIX, write_layers
from meshagent.testing.tiny_gguf import write_tiny_jamba, write_tiny_mamba, write_tiny_model

STEPS = 12
CHUNKS = (5, 17)  # then the rest: a prompt prefilled in three calls
# Four prompts of different lengths; the fifth reuses a cleared slot.
PROMPTS = [
    [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]
    for seed, n in ((1, 48), (2, 31), (3, 9), (4, 40), (5, 23))
]
WRITERS = {"mamba": write_tiny_mamba, "jamba": write_tiny_jamba}
# Jamba's type boundaries are 1, 2 and 4: each is a 2-stage cut; [0, 2, 4, 6] holds a mixed,
# a Mamba-only and an attention-only stage; [0, 1, 2, 6] a one-layer attention stage.
CUTS = [
    ("mamba", (0, 3, 6)),
    ("mamba", (0, 2, 4, 6)),
    ("jamba", (0, 1, 6)),
    ("jamba", (0, 2, 6)),
    ("jamba", (0, 4, 6)),
    ("jamba", (0, 3, 6)),
    ("jamba", (0, 2, 4, 6)),
    ("jamba", (0, 1, 2, 6)),
]


def greedy(engine, seq: int, prompt: list[int], chunks: tuple[int, ...] = ()):
    """Prefill (in `chunks` then the rest), then STEPS greedy tokens; all logits."""
    engine.clear_sequence(seq)
    pos = 0
    for n in (*chunks, len(prompt) - sum(chunks)):
        logits = engine.forward([ForwardItem(seq, pos, prompt[pos : pos + n], True)])[0]
        pos += n
    out = [logits]
    for _ in range(STEPS):
        token = int(np.argmax(out[-1]))
        out.append(engine.forward([ForwardItem(seq, pos, [token], True)])[0])
        pos += 1
    return out


def interleaved(engine) -> list[list[np.ndarray]]:
    """Four sequences prefilled in one call, then decoded together in a different order every
    step; halfway, slot 2 is cleared and reused by the fifth prompt. Each run's logits: the
    four sequences, then the fifth prompt's."""
    for s in range(4):
        engine.clear_sequence(s)
    first = engine.forward([ForwardItem(s, 0, PROMPTS[s], True) for s in range(4)])
    got: list[list[np.ndarray]] = [[lg] for lg in first]
    runs = list(range(4))  # which run each slot holds
    pos = [len(p) for p in PROMPTS[:4]]
    orders = [[0, 1, 2, 3], [2, 1, 0, 3], [3, 0, 2, 1]]
    for step in range(STEPS):
        if step == STEPS // 2:
            engine.clear_sequence(2)
            got.append(engine.forward([ForwardItem(2, 0, PROMPTS[4], True)]))
            runs[2], pos[2] = 4, len(PROMPTS[4])
        order = orders[step % len(orders)]
        items = [ForwardItem(s, pos[s], [int(np.argmax(got[runs[s]][-1]))], True) for s in order]
        for s, lg in zip(order, engine.forward(items), strict=True):
            got[runs[s]].append(lg)
            pos[s] += 1
    return got


def same(ours: list[np.ndarray], theirs: list[np.ndarray]) -> bool:
    return len(ours) == len(theirs) and all(
        np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True)
    )


def tokens(logits: list[np.ndarray]) -> list[int]:
    return [int(np.argmax(lg)) for lg in logits]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("recurrent")
    return {name: write(d / f"tiny-{name}.gguf") for name, write in WRITERS.items()}


@pytest.fixture(scope="module")
def reference(models):
    """Per model, on the whole model: each prompt alone, and four of them interleaved."""
    refs = {}
    for name, path in models.items():
        whole = LlamaEngine(path, slots=4, slot_ctx=128, threads=1, flash_attn=False)
        try:
            alone = [greedy(whole, 0, p) for p in PROMPTS]
            chunked = greedy(whole, 1, PROMPTS[0], CHUNKS)
            together = interleaved(whole)
        finally:
            whole.close()
        # llama.cpp itself gives the same logits for a prompt in one call or in several.
        assert same(chunked, alone[0])
        assert len(set(tokens(alone[0]))) > 3  # not a degenerate model
        # Prompts prefilled together, or in a reused slot, give their lone logits, and so do
        # batched decode steps: llama.cpp built without LLAMAFILE (the README's install) runs
        # the same kernels whatever the batch (with it, Jamba's differed in the last bits).
        for run, logits in enumerate(together):
            n = len(logits)
            assert same(logits, alone[run][:n])
        refs[name] = (alone, together)
    return refs


@pytest.mark.parametrize(("name", "cut"), CUTS, ids=[f"{n}-{c}" for n, c in CUTS])
def test_staged_equals_whole(name, cut, models, reference, store):
    alone, together = reference[name]
    staged = StagedEngine(models[name], cut, store, slots=4, slot_ctx=128, threads=1)
    try:
        # A prompt and greedy decoding; the same prompt prefilled in three calls.
        assert same(greedy(staged, 0, PROMPTS[0]), alone[0])
        assert same(greedy(staged, 1, PROMPTS[0], CHUNKS), alone[0])

        # Four sequences batched, one slot cleared and reused on the way: the whole model's
        # logits under the same batching.
        got = interleaved(staged)
        for run in range(5):
            assert same(got[run], together[run]), f"run {run}"

        # A slot reused alone after all that.
        assert same(greedy(staged, 2, PROMPTS[4]), alone[4])
    finally:
        staged.close()


def _engine(kind: str, path: Path, store):
    if kind == "whole":
        return LlamaEngine(path, slots=2, slot_ctx=128, threads=1, flash_attn=False)
    return StagedEngine(path, (0, 2, 4, 6), store, slots=2, slot_ctx=128, threads=1)


@pytest.mark.parametrize("kind", ["whole", "staged"])
@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_a_rejected_window_is_cut_back_from_its_checkpoint(name, kind, models, reference, store):
    """A verify window of three right tokens and two wrong ones, cut back to the right ones:
    the state is loaded from before the window and the right ones run again, so decoding
    goes on with the logits of plain greedy decoding."""
    alone = reference[name][0][0]
    greedy_tokens = tokens(alone)
    prompt = PROMPTS[0]
    pos = len(prompt)
    engine = _engine(kind, models[name], store)
    try:
        engine.clear_sequence(0)
        engine.forward([ForwardItem(0, 0, prompt, True)])
        wrong = [(t + 1) % 259 for t in greedy_tokens[3:5]]
        window = greedy_tokens[:3] + wrong
        rows = engine.forward([ForwardItem(0, pos, window, True, len(window))])[0]
        # The rows of the right tokens are one-token steps' logits.
        assert all(np.array_equal(rows[i], alone[i + 1]) for i in range(3))
        engine.trim_sequence(0, pos + 3)
        out = [engine.forward([ForwardItem(0, pos + 3, [greedy_tokens[3]], True)])[0]]
        for i in range(4, 8):
            out.append(engine.forward([ForwardItem(0, pos + i, [greedy_tokens[i]], True)])[0])
        assert same(out, alone[4:9])
        # Past the last decode of several tokens there is no checkpoint: refused, and the
        # sequence goes on unchanged.
        with pytest.raises(EngineError, match="recurrent state"):
            engine.trim_sequence(0, pos + 2)
        out = engine.forward([ForwardItem(0, pos + 8, [greedy_tokens[8]], True)])[0]
        assert np.array_equal(out, alone[9])
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_recurrent_state_moves_between_contexts(name, models, reference, store):
    alone = reference[name][0][0]
    prompt = PROMPTS[0]
    a = StagedEngine(models[name], (0, 2, 4, 6), store, slots=2, slot_ctx=128, threads=1)
    b = StagedEngine(models[name], (0, 2, 4, 6), store, slots=2, slot_ctx=128, threads=1)
    try:
        a.clear_sequence(0)
        assert np.array_equal(a.forward([ForwardItem(0, 0, prompt, True)])[0], alone[0])
        a.trim_sequence(0, len(prompt))  # keeps everything
        # Each stage's state of the sequence moves to another context's slot, as a sequence
        # would move to another peer, and decoding goes on there exactly.
        for sa, sb in zip(a.stages, b.stages, strict=True):
            sb.runtime.import_sequence(1, sa.runtime.export_sequence(0))
        token = int(np.argmax(alone[0]))
        for engine, seq in ((a, 0), (b, 1)):
            out = engine.forward([ForwardItem(seq, len(prompt), [token], True)])[0]
            assert np.array_equal(out, alone[1])
    finally:
        a.close()
        b.close()


def test_family_traits(models, tmp_path):
    mamba = family_traits(inspect_model(models["mamba"]))
    assert mamba.layer_types == ("recurrent",) * 6
    assert (mamba.state_kind, mamba.type_boundaries) == ("recurrent", ())
    jamba = family_traits(inspect_model(models["jamba"]))
    assert jamba.layer_types == (
        "recurrent",
        "attention",
        "recurrent",
        "recurrent",
        "attention",
        "attention",
    )
    assert (jamba.state_kind, jamba.type_boundaries) == ("hybrid", (1, 2, 4))
    llama = family_traits(inspect_model(write_tiny_model(tmp_path / "llama.gguf", "llama")))
    assert (llama.state_kind, llama.layer_types, llama.rewindable) == (
        "kv",
        ("attention",) * 6,
        True,
    )
    assert llama.splittable
    for traits in (mamba, jamba):
        # The stage engine runs them; the planner splits them only once certified.
        assert traits.certifiable and not traits.splittable
        assert traits.state_portable and not traits.rewindable


def test_jamba_slices_cut_the_layer_pattern(models, tmp_path):
    layout = inspect_model(models["jamba"])
    key = "jamba.attention.head_count_kv"
    cases = {
        (0, 2): (0, [0, 2]),
        (1, 4): (0, [2, 0, 0]),
        (2, 4): (1, [2, 0, 0]),  # Mamba only: a zeroed attention layer in front
        (4, 6): (1, [0, 2, 2]),  # attention only: a zeroed Mamba layer in front
    }
    for (a, b), (pad, head_kv) in cases.items():
        dst = tmp_path / f"jamba-{a}-{b}.gguf"
        write_layers(layout, a, b, dst, provenance={})
        reader = open_gguf(dst)
        pads = reader.fields.get(SLICE_KEY_PREFIX + PAD_LAYERS_KEY)
        assert (0 if pads is None else int(pads.contents())) == pad
        assert list(reader.fields[key].contents()) == head_kv
        if pad:
            blk0 = [t for t in reader.tensors if t.name.startswith("blk.0.")]
            assert blk0 and all(not np.any(t.data) for t in blk0)


def test_planner_still_refuses_them(models, tmp_path):
    layout = inspect_model(models["jamba"])
    assert layout.stage_refusal is None
    assert not layout.splittable and "certified" in (layout.split_refusal or "")
    other = inspect_model(write_tiny_model(tmp_path / "olmo.gguf", "olmo"))
    assert "no parity test" in (other.stage_refusal or "")
    with pytest.raises(ModelError, match="no parity test"):
        write_layers(other, 0, 3, tmp_path / "olmo-0-3.gguf", provenance={})
