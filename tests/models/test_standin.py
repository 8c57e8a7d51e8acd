"""The last stage of a model with its own output head carries zero token embeddings in the
smallest type its width allows (llama.cpp loads no model without them, and the last stage never
looks a token up), and the plan counts exactly what the slice holds."""

from __future__ import annotations

import numpy as np
import pytest

from meshagent.models.gguf_file import GGUFFile
from meshagent.models.layout import inspect_model, standin_bytes
from meshagent.models.slicer import tensors_read, write_layers
from meshagent.placement.costs import ModelCost
from meshagent.testing.tiny_gguf import write_tiny_gemma, write_tiny_model
from tests.engine.test_stage_parity import assert_splits_exactly


def _tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize(("n_embd", "kind"), [(64, "Q4_0"), (256, "IQ1_S"), (72, "F16")])
def test_a_last_slice_carries_zero_embeddings_and_the_plan_counts_its_bytes(tmp_path, n_embd, kind):
    n_head = 4 if n_embd != 72 else 6
    src = write_tiny_model(tmp_path / "m.gguf", "llama", n_embd=n_embd, n_head=n_head)
    layout = inspect_model(src)
    assert not layout.tied_embeddings
    dst = tmp_path / "last.gguf"
    write_layers(layout, 3, 6, dst, provenance={})
    got = _tensors(dst)
    embd = got["token_embd.weight"]
    assert embd.tensor_type.name == kind
    assert [int(x) for x in embd.shape] == [n_embd, layout.n_vocab]
    assert not np.asarray(embd.data).any()
    # The real head is copied as it is.
    source = _tensors(src)
    assert np.array_equal(got["output.weight"].data, source["output.weight"].data)
    # The slice holds what the layout and the planner say it holds.
    held = sum(int(t.n_bytes) for n, t in got.items() if n.startswith(("blk.", "output", "token")))
    assert held == layout.weight_bytes(3, 6)
    assert held == ModelCost.from_layout("m", layout).weight_bytes(3, 6)
    assert int(embd.n_bytes) == standin_bytes(layout.n_vocab, n_embd, tied=False)
    assert int(embd.n_bytes) <= layout.embedding_bytes // 2  # the source is float32
    # A download of the slice reads no embeddings from the model.
    assert "token_embd.weight" not in tensors_read(layout, "layers", 3, 6)
    assert "output.weight" in tensors_read(layout, "layers", 3, 6)


def test_a_split_with_a_stand_in_gives_the_whole_models_logits(tmp_path, store):
    src = write_tiny_model(tmp_path / "wide.gguf", "llama", n_embd=256, n_head=4, n_ff=256)
    assert_splits_exactly(src, [0, 2, 6], store)


def test_a_tied_model_keeps_its_embeddings_as_the_head(tmp_path):
    src = write_tiny_gemma(tmp_path / "gemma.gguf", "gemma")
    layout = inspect_model(src)
    assert layout.tied_embeddings
    dst = tmp_path / "last.gguf"
    write_layers(layout, 3, 6, dst, provenance={})
    source = GGUFFile(src)
    want = next(t for t in source.tensors if t.name == "token_embd.weight")
    got = _tensors(dst)["token_embd.weight"]
    assert got.tensor_type == want.tensor_type and int(got.n_bytes) == int(want.n_bytes)
    assert standin_bytes(layout.n_vocab, layout.n_embd, tied=True) == 0
    assert "token_embd.weight" in tensors_read(layout, "layers", 3, 6)
