"""What serving asks of an engine beyond a forward pass, for every family, whole and split
(the family table in docs/engine.md): a verify window computes what one-token steps compute, a
rejected draft is cut back exactly (a KV cache trimmed, a recurrent state loaded from its
checkpoint and the kept tokens run again), and a sequence's state exported from one slot and
imported into another goes on exactly (a kept prefix)."""

from __future__ import annotations

import numpy as np
import pytest

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.split_in_process import StagedEngine
from meshagent.engine.windows import check_windows
from meshagent.testing.tiny_gguf import FAMILIES

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 259, 60)]
STEPS = 10


def _engine(kind: str, path, store):
    if kind == "whole":
        return LlamaEngine(path, slots=2, slot_ctx=256, threads=1, flash_attn=False)
    return StagedEngine(path, (0, 2, 4, 6), store, slots=2, slot_ctx=256, threads=1)


def _step(engine, seq: int, pos: int, token: int) -> np.ndarray:
    return engine.forward([ForwardItem(seq, pos, [token], True)])[0]


@pytest.mark.parametrize("kind", ["whole", "split"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_windows_drafts_and_kept_prefixes(family, kind, tmp_path, store):
    path = FAMILIES[family](tmp_path / f"tiny-{family}.gguf")
    engine = _engine(kind, path, store)
    try:
        if kind == "whole":
            # The load-time check that lets `--speculation auto` draft (and prefixes be kept).
            assert check_windows(engine).exact
        pos = len(PROMPT)
        # Plain greedy decoding: the reference.
        engine.clear_sequence(0)
        ref = [engine.forward([ForwardItem(0, 0, PROMPT, True)])[0]]
        greedy = []
        for i in range(STEPS):
            greedy.append(int(np.argmax(ref[-1])))
            ref.append(_step(engine, 0, pos + i, greedy[-1]))

        # A window of three right tokens and two wrong ones, cut back to the right ones.
        engine.clear_sequence(0)
        engine.forward([ForwardItem(0, 0, PROMPT, True)])
        window = greedy[:3] + [(t + 1) % 259 for t in greedy[3:5]]
        rows = engine.forward([ForwardItem(0, pos, window, True, len(window))])[0]
        assert all(np.array_equal(rows[i], ref[i + 1]) for i in range(3))
        engine.trim_sequence(0, pos + 3)
        assert np.array_equal(_step(engine, 0, pos + 3, greedy[3]), ref[4])

        # Its state, as a kept prefix: into the other slot, where decoding goes on exactly
        # (in a split, each stage keeps its own layers' state).
        engine.clear_sequence(1)
        for part in engine.stages if kind == "split" else [engine]:
            part.import_sequence(1, part.export_sequence(0, pos + 4))
        for i in range(4, STEPS):
            assert np.array_equal(_step(engine, 1, pos + i, greedy[i]), ref[i + 1]), i
    finally:
        engine.close()
