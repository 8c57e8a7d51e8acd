"""llama.cpp computes a draft's window exactly as one-token steps, as installed by the README
(llama-cpp-python built without LLAMAFILE, flash attention off): what lets speculation change
no token."""

from __future__ import annotations

from meshagent.engine.llama import LlamaEngine
from meshagent.engine.runtime import built_with_llamafile
from meshagent.engine.windows import check_windows


def test_windows_are_exact_on_the_installed_build(model_path):
    assert not built_with_llamafile(), "reinstall llama-cpp-python as the README says"
    engine = LlamaEngine(model_path, slots=2, slot_ctx=512, threads=2)
    try:
        check = check_windows(engine, slot=1, steps=12)
        assert check.exact, check.reason
        assert check.positions == 12
    finally:
        engine.close()


def test_flash_attention_is_taken_as_inexact_without_a_check(model_path):
    # Past 512 tokens of context its one-token steps take another kernel than windows: a
    # check at a short context would pass and mislead.
    engine = LlamaEngine(model_path, slots=1, slot_ctx=256, threads=1, flash_attn=True)
    try:
        check = check_windows(engine)
        assert not check.exact and check.positions == 0
        assert "flash attention" in check.reason
    finally:
        engine.close()
