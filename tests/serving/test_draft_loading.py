"""`--draft-model` loaded beside a model: a file as given; `auto` the embedded SmolLM2, only
for a target several times its size."""

from __future__ import annotations

import pytest

from meshagent.config import AgentConfig
from meshagent.engine.llama import LlamaEngine
from meshagent.errors import ConfigError
from meshagent.models.default import default_model_path, draft_model_path
from meshagent.serving.draft_loading import AUTO_RATIO, load_draft
from meshagent.serving.settings import ServingSettings


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
