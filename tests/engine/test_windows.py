"""llama.cpp computes a draft's window exactly as one-token steps, as installed by the README
(llama-cpp-python built without LLAMAFILE, flash attention off): what lets speculation change
no token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llama_cpp

from meshagent.engine.llama import LlamaEngine
from meshagent.engine.runtime import (
    REPACK_ENV,
    TILED_ENV,
    built_with_llamafile,
    cpu_has_amx,
    inexact_model,
)
from meshagent.engine.windows import check_windows
from meshagent.testing.tiny_gguf import quantize, write_tiny_model


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


_CHECK = """
import json, sys
from pathlib import Path
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.windows import check_windows
engine = LlamaEngine(Path(sys.argv[1]), slots=1, slot_ctx=256, threads=2)
check = check_windows(engine)
print(json.dumps({"exact": check.exact, "reason": check.reason}))
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


def test_k_quant_windows_are_exact_unless_weights_are_repacked_or_tiled(tmp_path):
    # llama.cpp multiplies K-quant weights by a batch of 8 tokens or more with tiled kernels
    # that round otherwise than its dot products: an agent turns them off (decision 11). On a
    # CPU with AVX2 (and no AMX) llama.cpp can also repack such weights at load and multiply
    # 4 rows or more with another kernel: an agent loads without repacking (decision 12). A
    # user who turns either back on is told that windows are inexact, and why.
    f32 = write_tiny_model(tmp_path / "f32.gguf", "llama", n_layers=2, n_embd=256, n_ff=512)
    model = quantize(f32, tmp_path / "q4_k_m.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)

    def check(**env: str) -> dict:
        base = {k: v for k, v in os.environ.items() if k not in (TILED_ENV, REPACK_ENV)}
        out = subprocess.run(
            [sys.executable, "-c", _CHECK, str(model)],
            env={**base, **env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])

    assert check() == {"exact": True, "reason": "a window's logits equal one-token steps"}
    tiled = check(**{TILED_ENV: "1"})
    assert not tiled["exact"]
    assert f"unset {TILED_ENV}" in tiled["reason"]
    repacked = check(**{REPACK_ENV: "1"})
    if "avx2" in _cpu_flags() and not cpu_has_amx():
        assert not repacked["exact"]
    if not repacked["exact"]:
        assert "Q4_K" in repacked["reason"] and f"unset {REPACK_ENV}" in repacked["reason"]


def test_only_repacked_weight_types_are_judged_inexact(monkeypatch):
    monkeypatch.setattr("meshagent.engine.runtime.cpu_has_amx", lambda: False)
    monkeypatch.delenv(REPACK_ENV, raising=False)
    assert inexact_model(["Q4_K"]) == ""  # not repacked unless asked
    monkeypatch.setenv(REPACK_ENV, "1")
    assert inexact_model(["F32", "Q4_1"]) == ""
    why = inexact_model(["F32", "Q6_K", "Q4_K"])
    assert "Q4_K, Q6_K" in why and f"unset {REPACK_ENV}" in why
    monkeypatch.setattr("meshagent.engine.runtime.cpu_has_amx", lambda: True)
    assert inexact_model(["Q4_K"]) == ""  # no extra buffer types on AMX CPUs
