"""`--draft-model` loaded beside a model: a file as given; `auto` a catalogued model of the
target's vocabulary at most a sixth of its size, here and fitting, else the embedded SmolLM2,
only for a target several times its size."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from meshagent.catalog.entry import CatalogEntry
from meshagent.config import AgentConfig
from meshagent.engine.llama import LlamaEngine, read_model_info
from meshagent.errors import ConfigError
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import default_model_path, draft_model_path
from meshagent.models.layout import inspect_model
from meshagent.serving.draft_loading import (
    AUTO_RATIO,
    catalogued_draft,
    draft_candidates,
    load_draft,
)
from meshagent.serving.model_files import ModelFiles
from meshagent.serving.settings import ServingSettings
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.catalog.support import T0


async def test_auto_drafts_with_the_embedded_model_for_a_target_several_times_its_size():
    small = default_model_path().stat().st_size
    settings = ServingSettings(slots=1, slot_ctx=256, threads=1, draft_model="auto")
    target = LlamaEngine(default_model_path(), slots=1, slot_ctx=256, threads=1)
    try:
        # A target about its size: drafts would cost what they save, so none.
        assert await load_draft(settings, target, small) == (None, None)
        engine, draft = await load_draft(settings, target, AUTO_RATIO * small)
        assert engine is not None and draft is not None
        try:
            assert draft.same_vocab and draft.name == target.info.id
            draft.open(0, target.tokenize("The river flows", add_bos=True))
            assert len(draft.propose(0, 4)) == 4
        finally:
            engine.close()
    finally:
        target.close()


def test_a_draft_model_is_a_file_a_hub_name_or_auto():
    assert draft_model_path("auto") == default_model_path()
    for ok in ("auto", str(default_model_path()), "bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"):
        AgentConfig(draft_model=ok).validate()
    with pytest.raises(ConfigError, match=r"no GGUF file at /nowhere/small\.gguf"):
        AgentConfig(draft_model="/nowhere/small.gguf").validate()


# ----- `auto` among the catalogue's models -----


def _catalogued(
    tmp_path: Path, store: ArtifactStore, name: str, **shape
) -> tuple[Path, CatalogEntry]:
    path = write_tiny_model(tmp_path / f"{name}.gguf", "llama", **shape)
    layout = inspect_model(path)
    entry = CatalogEntry.add(
        name, str(path), store.source_sha256(path), layout.file_bytes, layout, version=1, time=T0
    )
    return path, entry


@pytest.fixture
def shelf(tmp_path):
    """A target and models that could or could not draft for it, all catalogued."""
    store = ArtifactStore(tmp_path / "store")
    made = {
        "target": _catalogued(tmp_path, store, "target", n_embd=256, n_ff=1024, n_layers=6),
        "small": _catalogued(tmp_path, store, "small", n_embd=32, n_ff=64, n_layers=2),
        "smaller": _catalogued(tmp_path, store, "smaller", n_embd=16, n_ff=32, n_layers=2),
        # A sixth of the target's size or more: its drafts would cost what they save.
        "big": _catalogued(tmp_path, store, "big", n_embd=128, n_ff=512, n_layers=6),
    }
    target_path = made["target"][0]
    files = ModelFiles(target_path, inspect_model(target_path), read_model_info(target_path), store)
    return files, {name: entry for name, (_, entry) in made.items()}, store


def test_the_candidates_share_the_targets_vocabulary_and_are_a_sixth_of_its_size_or_less(shelf):
    files, entries, _ = shelf
    other = replace(entries["small"], name="other-vocab", vocab_sha256="ef" * 32)
    unread = replace(entries["small"], name="unread", vocab_sha256="")
    pool = [*entries.values(), other, unread]
    size, vocab = files.info.size_bytes, files.layout.vocab_sha256
    assert [e.name for e in draft_candidates(pool, vocab, size)] == ["small", "smaller"]
    assert AUTO_RATIO * entries["big"].size > size >= AUTO_RATIO * entries["small"].size
    assert draft_candidates(pool, "", size) == []  # (a target whose vocabulary was not read)


async def test_auto_takes_the_largest_candidate_here_that_is_the_catalogued_file_and_fits(shelf):
    files, entries, _ = shelf
    pool = list(entries.values())
    free = [1 << 40]
    find = partial(catalogued_draft, pool, files, need=lambda p: p.stat().st_size)
    assert await find(free=lambda: free[0]) == Path(entries["small"].source)
    # Not where its file is another's (its sha256 is not the catalogued one) ...
    moved = [replace(e, sha256="00" * 32) if e.name == "small" else e for e in pool]
    got = await catalogued_draft(moved, files, need=lambda p: 0, free=lambda: 1)
    assert got == Path(entries["smaller"].source)
    # ... nor where it is not here, nor where it does not fit.
    gone = [
        replace(e, source=str(files.path.parent / "nowhere.gguf")) if e.name == "small" else e
        for e in pool
    ]
    assert await catalogued_draft(gone, files, need=lambda p: 0, free=lambda: 1) == Path(
        entries["smaller"].source
    )
    tight = entries["smaller"].size
    assert await find(free=lambda: tight) == Path(entries["smaller"].source)
    assert await find(free=lambda: tight - 1) is None


async def test_auto_loads_the_catalogued_draft_model_it_finds_token_for_token(shelf):
    files, entries, _ = shelf
    settings = ServingSettings(slots=1, slot_ctx=256, threads=1, draft_model="auto")
    target = LlamaEngine(files.path, slots=1, slot_ctx=256, threads=1)
    try:

        async def find() -> Path:
            return Path(entries["small"].source)

        engine, draft = await load_draft(settings, target, files.info.size_bytes, find=find)
        assert engine is not None and draft is not None
        try:
            assert draft.same_vocab and draft.name == "small"
            draft.open(0, target.tokenize("The river flows", add_bos=True))
            assert len(draft.propose(0, 4)) >= 1
        finally:
            engine.close()

        # Found none, and the target is smaller than six embedded draft models: none.
        async def none() -> None:
            return None

        assert await load_draft(settings, target, files.info.size_bytes, find=none) == (None, None)
    finally:
        target.close()
