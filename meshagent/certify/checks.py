"""Certifying a model for split serving: staged execution against the whole model, per cut and
per wire dtype, on the certification prompts.

For each prompt the whole model (llama.cpp, one context) prefills the prompt and generates
greedily; its logits at every position are the reference. Each cut (a list of stage
boundaries) runs as a `StagedEngine` (every stage its own llama.cpp context, loading its own
artifact, as on separate peers) and is fed the same tokens: the prompt, then the whole
model's tokens one by one (teacher forcing). At every position we compare the argmax (top-1
agreement) and the largest logit difference. A split's greedy text is identical to the whole
model's exactly when every teacher-forced argmax agrees: until the first disagreement both
have seen the same tokens, so that measure is the greedy-identity check as well.

Chunked prefill: the prompt is also prefilled in chunks, by the whole model and by each
split, and the logits after each chunk compared, so the state each stage keeps across
decode calls (KV cache or recurrent state) is checked too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshagent.certify.prompts import PROMPTS, Prompt
from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.split_in_process import StagedEngine
from meshagent.engine.stage import WIRE_DTYPES
from meshagent.errors import ModelError
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.layout import ModelLayout
from meshagent.serving.chat import ChatMessage, ChatTemplate

CHUNK = 16  # tokens per prefill chunk in the chunked-prefill check
BATCH = 256  # tokens per decode call otherwise (whole and split alike)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    tokens: int = 24  # greedy tokens generated after each prompt
    ctx: int = 1024  # context certified: the long prompt fills it, less `tokens`
    threads: int = 0
    dtypes: tuple[str, ...] = tuple(WIRE_DTYPES)
    cuts: tuple[tuple[int, ...], ...] = ()  # empty: chosen by `default_cuts`


@dataclass
class CutResult:
    cut: tuple[int, ...]
    dtype: str
    positions: int = 0
    agree: int = 0
    max_logit_diff: float = 0.0
    first_divergence: dict[str, int] = field(default_factory=dict)  # prompt -> position
    chunked_identical: bool = True
    chunked_max_diff: float = 0.0

    @property
    def greedy_identical(self) -> bool:
        return self.agree == self.positions


@dataclass(frozen=True)
class Reference:
    prompt: Prompt
    tokens: tuple[int, ...]  # the prompt's tokens
    generated: tuple[int, ...]  # the whole model's greedy tokens
    logits: tuple[np.ndarray, ...]  # after the prompt, then after each generated token
    chunked: tuple[np.ndarray, ...]  # after each prefill chunk


def default_cuts(n_layers: int, boundaries: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
    """Two and three stages of equal layer counts, and a two-stage cut at every layer-type
    boundary (hybrid models)."""
    cuts = []
    if n_layers >= 2:
        cuts.append((0, n_layers // 2, n_layers))
    if n_layers >= 3:
        cuts.append((0, n_layers // 3, 2 * n_layers // 3, n_layers))
    cuts += [(0, b, n_layers) for b in boundaries if 0 < b < n_layers]
    return tuple(dict.fromkeys(cuts))


def prompt_tokens(engine: LlamaEngine, prompt: Prompt, ctx: int, tokens: int) -> list[int]:
    """The prompt's tokens, cut to leave room for `tokens` more in a context of `ctx`."""
    room = ctx - tokens
    if prompt.chat:
        template = ChatTemplate.for_model(engine)
        text = template.render([ChatMessage("user", prompt.text)])
        return engine.tokenize(text, add_bos=False)[-room:]
    if not prompt.fill_to_ctx:
        return engine.tokenize(prompt.text, add_bos=True)[:room]
    unit = max(1, len(engine.tokenize(prompt.text, add_bos=False)))
    text = prompt.text * (room // unit + 2)
    return engine.tokenize(text, add_bos=True)[:room]


def _prefill(engine, tokens: Sequence[int], chunk: int) -> list[np.ndarray]:
    """Prefill in chunks of `chunk` tokens; the logits after each."""
    engine.clear_sequence(0)
    out = []
    for at in range(0, len(tokens), chunk):
        part = list(tokens[at : at + chunk])
        out.append(engine.forward([ForwardItem(0, at, part, True)])[0].copy())
    return out


def _teacher_forced(engine, tokens: Sequence[int], feed: Sequence[int]) -> list[np.ndarray]:
    """Prefill `tokens`, then feed `feed` one token at a time; the logits after the prompt and
    after each token fed."""
    logits = _prefill(engine, tokens, BATCH)[-1:]
    pos = len(tokens)
    for tok in feed:
        logits.append(engine.forward([ForwardItem(0, pos, [tok], True)])[0].copy())
        pos += 1
    return logits


def references(whole: LlamaEngine, settings: Settings, progress: Progress) -> list[Reference]:
    refs = []
    for p in PROMPTS:
        tokens = prompt_tokens(whole, p, settings.ctx, settings.tokens)
        logits = _prefill(whole, tokens, BATCH)[-1:]
        generated: list[int] = []
        pos = len(tokens)
        for _ in range(settings.tokens):
            generated.append(int(np.argmax(logits[-1])))
            logits.append(whole.forward([ForwardItem(0, pos, [generated[-1]], True)])[0].copy())
            pos += 1
        chunked = _prefill(whole, tokens, CHUNK)
        refs.append(Reference(p, tuple(tokens), tuple(generated), tuple(logits), tuple(chunked)))
        progress(f"whole model: {p.name} ({len(tokens)} prompt tokens)")
    return refs


def check_cut(
    staged: StagedEngine, dtype: str, refs: Sequence[Reference], progress: Progress
) -> CutResult:
    staged.wire_dtype = WIRE_DTYPES[dtype]
    cut = tuple([0, *(s.end for s in staged.stages)])
    res = CutResult(cut, dtype)
    for ref in refs:
        got = _teacher_forced(staged, ref.tokens, ref.generated)
        for i, (a, b) in enumerate(zip(ref.logits, got, strict=True)):
            res.positions += 1
            if int(np.argmax(a)) == int(np.argmax(b)):
                res.agree += 1
            elif ref.prompt.name not in res.first_divergence:
                res.first_divergence[ref.prompt.name] = i
            res.max_logit_diff = max(res.max_logit_diff, float(np.max(np.abs(a - b))))
        chunks = _prefill(staged, ref.tokens, CHUNK)
        for a, b in zip(ref.chunked, chunks, strict=True):
            res.chunked_max_diff = max(res.chunked_max_diff, float(np.max(np.abs(a - b))))
            if int(np.argmax(a)) != int(np.argmax(b)):
                res.chunked_identical = False
        progress(f"cut {'/'.join(map(str, cut))} {dtype}: {ref.prompt.name}")
    return res


@dataclass
class Certification:
    layout: ModelLayout
    settings: Settings
    references: list[Reference]
    results: list[CutResult]
    seconds: float
    certified_ctx: int


def certify_model(
    layout: ModelLayout,
    store: ArtifactStore,
    settings: Settings,
    *,
    type_boundaries: Sequence[int] = (),
    progress: Progress = lambda _: None,
) -> Certification:
    """Run every check; raises ModelError if the model cannot be split at all."""
    if layout.n_layers < 2:
        raise ModelError(f"{layout.name} has {layout.n_layers} layer: nothing to split")
    t0 = time.monotonic()
    path = Path(layout.path)
    cuts = settings.cuts or default_cuts(layout.n_layers, type_boundaries)
    whole = LlamaEngine(path, slots=1, slot_ctx=settings.ctx, threads=settings.threads)
    try:
        refs = references(whole, settings, progress)
    finally:
        whole.close()
    results = []
    for cut in cuts:
        staged = StagedEngine(
            path,
            cut,
            store,
            slots=1,
            slot_ctx=settings.ctx,
            threads=settings.threads,
            layout=layout,
        )
        try:
            for dtype in settings.dtypes:
                results.append(check_cut(staged, dtype, refs, progress))
        finally:
            staged.close()
    ctx = max(len(r.tokens) + len(r.generated) for r in refs)
    return Certification(layout, settings, refs, results, time.monotonic() - t0, ctx)
