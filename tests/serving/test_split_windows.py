"""A split's entry judges whether its stages compute a draft's window as one-token steps
without running one (its stages are on other agents): from the build, the settings and the
model's weight types. That judgment must agree with a real check of the same model."""

from __future__ import annotations

import llama_cpp
import pytest

from meshagent.engine.llama import LlamaEngine
from meshagent.engine.runtime import REPACK_ENV, cpu_has_amx
from meshagent.engine.stage import StageEngine
from meshagent.engine.windows import check_windows
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.layout import inspect_model
from meshagent.serving.pipeline import EntryEngine
from meshagent.testing.tiny_gguf import quantize, write_tiny_model
from tests.engine.test_windows import _cpu_flags


@pytest.mark.parametrize("repack", ["1", "0"])
def test_a_split_entry_judges_windows_as_a_check_of_the_whole_model_finds(
    tmp_path, monkeypatch, repack
):
    # Repacking is chosen at each load ($MESHAGENT_REPACK is read there), so one process
    # can compare both ways.
    monkeypatch.setenv(REPACK_ENV, repack)
    f32 = write_tiny_model(tmp_path / "f32.gguf", "llama", n_layers=2, n_embd=256, n_ff=512)
    model = quantize(f32, tmp_path / "q4_k_m.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    whole = LlamaEngine(model, slots=1, slot_ctx=256, threads=2)
    try:
        check, info = check_windows(whole), whole.info
    finally:
        whole.close()
    layout = inspect_model(model)
    assert "Q4_K" in layout.weight_types
    store = ArtifactStore(tmp_path / "store")
    entry_path, _ = store.ensure_entry(model, layout)
    first = StageEngine(
        store.ensure_layers(model, 0, 1, layout)[0],
        start=0,
        end=1,
        total_layers=layout.n_layers,
        slots=1,
        slot_ctx=256,
        threads=1,
    )
    entry = EntryEngine(entry_path, first, info, layout.weight_types)
    try:
        assert entry.exact_windows == check.exact, (entry.windows_reason, check.reason)
        if repack == "0":
            assert check.exact
        elif "avx2" in _cpu_flags() and not cpu_has_amx():
            assert not check.exact  # llama.cpp repacks Q4_K weights on such a CPU
        if not entry.exact_windows:
            assert f"unset {REPACK_ENV}" in entry.windows_reason
    finally:
        entry.vocab.close()
        first.close()
