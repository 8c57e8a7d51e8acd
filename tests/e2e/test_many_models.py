"""Agents that take part in several models at once (`--model A --model B`): each model has its
own placement, the API serves both, and two splits share the same agents, their stage streams
telling the models apart by label (`stage/1:MODEL`). Every answer is the one the model gives
served alone."""

from __future__ import annotations

import httpx

from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import invite, status, wait_for

SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
# A tiny model needs ~1.41 MB whole and ~0.71 MB a half with 2 slots of 256 tokens: with 10%
# headroom an agent offering 1200K holds no one whole, and two hold each model split.
SMALL = "1200K"
PROMPT = "The sea"


def _complete(agent, model_id: str) -> str:
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_models_split_over_the_same_two_agents_answer_as_each_served_alone(
    spawn_agent, tmp_path
):
    llama = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama", seed=3)
    qwen = write_tiny_model(tmp_path / "tiny-qwen.gguf", "qwen2", seed=4)
    ids = ["tiny-llama", "tiny-qwen"]
    models = ["--model", str(llama), "--model", str(qwen)]

    # Each model alone, whole, on an agent of its own mesh: the answers to match.
    alone = {}
    for model_id, path in zip(ids, (llama, qwen), strict=True):
        single = spawn_agent("--model", str(path), *SETTINGS, name=f"alone-{model_id}")
        alone[model_id] = _complete(single, model_id)

    a = spawn_agent(*models, "--max-memory", SMALL, *SETTINGS, name="a", wait_model=False)
    b = spawn_agent(
        *models, "--max-memory", SMALL, *SETTINGS, "--join", invite(a), name="b", wait_model=False
    )

    def routable(x) -> bool:
        placement = status(x)["placement"]
        return all(placement[m]["routable"] for m in ids)

    wait_for(lambda: routable(a) and routable(b), timeout=120)
    for model_id in ids:
        stages = status(a)["placement"][model_id]["stages"]
        assert len(stages) == 2, stages  # split over both agents

    listed = {m["id"] for m in httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"]}
    assert set(ids) <= listed
    for agent in (a, b):
        for model_id in ids:
            assert _complete(agent, model_id) == alone[model_id], (agent.data_dir.name, model_id)


def test_an_agent_is_planned_no_part_of_a_model_it_does_not_take_part_in(spawn_agent, tmp_path):
    """The mistake a new user made: a second agent joined without --model serves the embedded
    default; the first agent's model, too big for it alone, was split onto the second, which
    never loaded its part (requests failed 30 s later saying a stage was lost)."""
    llama = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama", seed=3)
    a = spawn_agent(
        "--model", str(llama), "--max-memory", SMALL, *SETTINGS, name="a", wait_model=False
    )
    b = spawn_agent(*SETTINGS, "--join", invite(a), name="b")  # the embedded default
    smol = "SmolLM2-135M-Instruct.Q4_1"
    wait_for(lambda: status(a)["placement"].get(smol) is None, timeout=5)  # a takes no part
    wait_for(lambda: smol in {m["id"] for m in _models(a)}, timeout=60)
    wait_for(lambda: "memory" in (status(a)["placement"]["tiny-llama"]["error"] or ""), 60)
    placement = status(a)["placement"]["tiny-llama"]
    assert placement["stages"] == [] and placement["replicas"] == []
    assert "tiny-llama" not in status(b)["placement"]
    # a still answers for the model b serves.
    body = {"model": smol, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{a.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _models(agent) -> list[dict]:
    return httpx.get(f"{agent.url}/v1/models", timeout=10).json()["data"]
