"""Whether an engine computes a verify window exactly as it computes one-token steps.

Speculative decoding keeps a drafted token where the model, run over the whole window in one
batch, samples it. That yields plain decoding's text only if each row of the window holds,
bit for bit, the logits a one-token step at that position gives. Whether it does is a property
of the engine's kernels, not of the algorithm: llama.cpp built with LLAMAFILE computes the
attention of a batch of two or more tokens with tinyBLAS and that of one token with its own
dot products, and the two round differently (docs/speculation.md); its tiled K-quant kernels
take a batch of 8 or more tokens only (decision 11). So each engine is checked when it is
loaded: `check_windows` decodes a short text one token at a time, then again in a window of 3
tokens and one of 9, and compares the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshagent.engine.base import Engine, ForwardItem

TEXT = (
    "The river bends twice before it reaches the old mill, where the water slows and the "
    "children count the fish that rest in the shade."
)


@dataclass(frozen=True)
class WindowCheck:
    exact: bool
    max_diff: float  # the largest |window row - one-token step| over the checked logits
    positions: int  # how many positions were compared
    reason: str  # one line for `meshagent status`


def check_windows(engine: Engine, *, slot: int = 0, steps: int = 12) -> WindowCheck:
    """Decode `steps` greedy tokens after TEXT one at a time in `slot`, then the same tokens
    in two windows (3 tokens, then the rest: 9 by default, past the size from which llama.cpp
    may take other kernels), and compare every row with its step. Clears `slot` before and
    after.
    An engine that names a reason its windows cannot be exact (`inexact_windows`) is not
    run."""
    known = getattr(engine, "inexact_windows", None)
    if known:
        return WindowCheck(False, float("nan"), 0, known)
    prompt = engine.tokenize(TEXT, add_bos=True)
    engine.clear_sequence(slot)
    try:
        logits = engine.forward([ForwardItem(slot, 0, prompt, True)])[0]
        tokens: list[int] = []
        steps_logits: list[np.ndarray] = []
        for i in range(steps):
            assert logits is not None
            tokens.append(int(np.argmax(logits)))
            logits = engine.forward([ForwardItem(slot, len(prompt) + i, tokens[-1:], True)])[0]
            steps_logits.append(logits)
        engine.clear_sequence(slot)
        engine.forward([ForwardItem(slot, 0, prompt, True)])
        rows: list[np.ndarray] = []
        split = min(3, steps - 1)
        for start, end in ((0, split), (split, steps)):
            window = tokens[start:end]
            out = engine.forward(
                [ForwardItem(slot, len(prompt) + start, window, True, len(window))]
            )[0]
            rows += list(np.asarray(out).reshape(len(window), -1))
    finally:
        engine.clear_sequence(slot)
    diff = max(float(np.abs(r - s).max()) for r, s in zip(rows, steps_logits, strict=True))
    if diff == 0.0:
        return WindowCheck(True, 0.0, steps, "a window's logits equal one-token steps")
    hint = getattr(engine, "windows_hint", None)
    reason = f"a window's logits differ from one-token steps by up to {diff:.3g}"
    return WindowCheck(False, diff, steps, f"{reason}; {hint}" if hint else reason)
