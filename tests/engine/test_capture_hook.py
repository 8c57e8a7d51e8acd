"""The C capture hook is built with the package; without it a Python callback does the same."""

from __future__ import annotations

import numpy as np
import pytest

from meshagent.engine import native
from meshagent.engine.base import ForwardItem
from meshagent.engine.split_in_process import StagedEngine
from meshagent.testing.tiny_gguf import write_tiny_gemma
from tests.engine.test_stage_parity import assert_splits_exactly


def test_the_native_hook_was_built_and_is_used():
    native._hook = None
    assert native.capture_hook().native


def test_python_fallback_gives_identical_results(model_path, store, monkeypatch):
    prompt = list(range(300, 340))

    def run() -> list[np.ndarray]:
        eng = StagedEngine(model_path, [0, 10, 20, 30], store, slots=1, slot_ctx=256)
        try:
            out = [eng.forward([ForwardItem(0, 0, prompt, True)])[0]]
            out.append(eng.forward([ForwardItem(0, len(prompt), [int(out[0].argmax())], True)])[0])
            return out
        finally:
            eng.close()

    native._hook = None
    with_c = run()
    monkeypatch.setattr(native, "_native_library", lambda: None)
    native._hook = None
    try:
        fallback = run()
        assert not native.capture_hook().native
    finally:
        native._hook = None
    for a, b in zip(with_c, fallback, strict=True):
        assert np.array_equal(a, b)


def test_python_fallback_restores_a_gemma_stages_input(tmp_path, store, monkeypatch):
    # Gemma 2 scales any input; its later stages' input is put back by the hook's restore.
    path = write_tiny_gemma(tmp_path / "tiny-gemma2.gguf", "gemma2")
    monkeypatch.setattr(native, "_native_library", lambda: None)
    native._hook = None
    try:
        assert_splits_exactly(path, [0, 1, 4, 6], store)
        assert not native.capture_hook().native
    finally:
        native._hook = None


def test_capture_refuses_overlong_names():
    with pytest.raises(Exception, match="too long"):
        native.Capture("x" * 80)
