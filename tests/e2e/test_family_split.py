"""Each family the planner splits by default, end to end: three agents too small for a tiny
random-weight model of it serve it as three stages with default flags, and every agent's
answers are those of one agent serving it whole (llama itself: SmolLM2,
tests/e2e/test_split_serving.py)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from meshagent.models.layout import inspect_model
from meshagent.testing.tiny_gguf import FAMILIES as TINY
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import answers_as_whole, spawn_mesh, status, stop_together, wait_for

SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
PROMPT = "The sea"
# Llama itself is SmolLM2's test; the recurrent families split once certified
# (tests/e2e/test_certified_split.py).
FAMILIES = {name: w for name, w in TINY.items() if name not in ("llama", "mamba", "jamba")}


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
    # One agent serving it whole, a mesh of its own: it starts while the three plan.
    whole = spawn_agent(*SETTINGS, "--model", str(model), name="whole")

    def placement(x):
        return status(x)["placement"][model_id]

    wait_for(lambda: all(placement(x)["routable"] for x in agents), timeout=120)
    assert len(placement(b)["stages"]) == 3, placement(b)
    answers_as_whole(whole, agents, model_id, PROMPT)
    # Stopping, each stage ends the streams it serves and the entry its stream down: no
    # connection waits out its drain grace for them.
    assert stop_together(agents) == []


def test_a_model_that_cannot_be_split_says_why_in_inspect_status_and_the_api(spawn_agent, tmp_path):
    # A window by layer index in a family that does not carry its flags per slice: refused.
    model = write_tiny_model(tmp_path / "tiny-window.gguf", "qwen2", sliding_window=64)
    reason = inspect_model(model).split_refusal
    assert reason and "sliding-window" in reason
    shown = subprocess.run(
        [sys.executable, "-m", "meshagent", "models", "inspect", str(model)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert reason in shown
    # One agent too small for it whole: nowhere to serve it, and every answer says why.
    small = spawn_agent(
        "--model", str(model), "--max-memory", _third(model), *SETTINGS, wait_model=False
    )
    # (The first plan may fail for want of the agent's own measurements; then it says why.)
    wait_for(lambda: reason in (status(small)["placement"][model.stem]["error"] or ""), 60)
    body = {"model": model.stem, "prompt": PROMPT, "max_tokens": 4}
    r = httpx.post(f"{small.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    assert reason in r.json()["error"]["message"]
