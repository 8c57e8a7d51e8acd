"""Each family the planner splits by default, end to end: three agents too small for a tiny
random-weight model of it serve it as three stages with default flags, and every agent's
answers are those of one agent serving it whole (llama itself: SmolLM2,
tests/e2e/test_split_serving.py)."""

from __future__ import annotations

import pytest

from meshagent.models.layout import inspect_model
from meshagent.testing.tiny_gguf import (
    write_tiny_cohere2,
    write_tiny_deepseek2,
    write_tiny_gemma,
    write_tiny_gpt_oss,
    write_tiny_model,
)
from tests.e2e.agents import answers_as_whole, spawn_mesh, status, wait_for

SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
PROMPT = "The sea"
FAMILIES = {
    "qwen2": lambda path: write_tiny_model(path, "qwen2"),
    "qwen3": lambda path: write_tiny_model(path, "qwen3"),
    "phi3": lambda path: write_tiny_model(path, "phi3"),
    "mixtral": lambda path: write_tiny_model(path, "llama", experts=True),
    "qwen2moe": lambda path: write_tiny_model(path, "qwen2moe"),
    "qwen3moe": lambda path: write_tiny_model(path, "qwen3moe"),
    "deepseek2": lambda path: write_tiny_deepseek2(path),
    "gemma2": lambda path: write_tiny_gemma(path, "gemma2"),
    "gemma3": lambda path: write_tiny_gemma(path, "gemma3"),
    "cohere2": lambda path: write_tiny_cohere2(path),
    "gpt-oss": lambda path: write_tiny_gpt_oss(path),
}


def _third(model) -> str:
    """An offer no one or two agents can hold the model in, and three can: 45% of its weights
    and its KV cache for the slots (the compute buffers come out of the memory beyond it)."""
    layout = inspect_model(model)
    kv = layout.kv_bytes_per_token_per_layer * layout.n_layers * 2 * 256
    return f"{(layout.file_bytes + kv) * 45 // 100 // 1024}K"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_three_agents_split_a_family_and_answer_as_the_whole_model(spawn_agent, tmp_path, family):
    model = FAMILIES[family](tmp_path / f"tiny-{family}.gguf")
    model_id = model.stem
    args = ["--model", str(model), "--max-memory", _third(model), *SETTINGS]
    agents = spawn_mesh(spawn_agent, *args)
    b = agents[1]

    def placement(x):
        return status(x)["placement"][model_id]

    wait_for(lambda: all(placement(x)["routable"] for x in agents), timeout=120)
    assert len(placement(b)["stages"]) == 3, placement(b)
    whole = spawn_agent(*SETTINGS, "--model", str(model), name="whole")
    answers_as_whole(whole, agents, model_id, PROMPT)
