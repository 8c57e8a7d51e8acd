"""The embedder on the embedded model: unit vectors, one input's vector whatever came before
it, input text never read as special tokens, and its model loaded as every engine's is (on
AMX CPUs, without the AMX-repacked weights whose matrix multiply crashes llama.cpp 0.3.36)."""

from __future__ import annotations

import numpy as np
import pytest

from meshagent.engine import embedder as embedder_module
from meshagent.engine import runtime
from meshagent.engine.embedder import LlamaEmbedder
from meshagent.errors import EngineError
from meshagent.models.default import default_model_path


@pytest.fixture(scope="module")
def embedder():
    e = LlamaEmbedder(default_model_path(), n_ctx=128, threads=2)
    yield e
    e.close()


def test_vectors_are_unit_length_and_the_same_whatever_came_before(embedder):
    cat = embedder.embed(embedder.tokenize("A cat sleeps on the warm windowsill."))
    embedder.embed(embedder.tokenize("Quarterly revenue rose by four percent."))
    again = embedder.embed(embedder.tokenize("A cat sleeps on the warm windowsill."))
    assert cat.shape == (embedder.n_embd,)
    assert np.isclose(np.linalg.norm(cat), 1.0)
    assert np.array_equal(cat, again)


def test_input_text_is_not_read_as_special_tokens(embedder):
    tokens = embedder.tokenize("<|im_start|>")
    assert len(tokens) > 2  # BOS, then the text's own pieces, not the one control token


def test_an_input_longer_than_the_context_is_an_error(embedder):
    with pytest.raises(EngineError, match="does not fit"):
        embedder.embed([1] * 129)


def test_its_model_loads_without_amx_repacked_weights_on_amx_cpus(monkeypatch):
    seen = []
    real = runtime.model_params

    def spy(**kw):
        params = real(**kw)
        seen.append(params.use_extra_bufts)
        return params

    monkeypatch.setattr(runtime, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(runtime, "model_params", spy)
    e = embedder_module.LlamaEmbedder(default_model_path(), n_ctx=32, threads=1)
    try:
        assert seen == [False]
        assert np.isclose(np.linalg.norm(e.embed(e.tokenize("hello"))), 1.0)
    finally:
        e.close()
