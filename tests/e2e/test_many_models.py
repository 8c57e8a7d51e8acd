"""Agents that take part in several models at once (`--model A --model B`): the mesh's
assignment shares their memory between the models, each model has its own placement, the API
serves both, and two splits share agents, their stage streams telling the models apart by
label (`stage/1:MODEL`). Every answer is the one the model gives served alone."""

from __future__ import annotations

import httpx

from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import invite, status, wait_for

SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
# A tiny model needs ~1.41 MB whole, ~0.71 MB a half and 0.43-0.49 MB a third with 2 slots of
# 256 tokens: with 10% headroom an agent offering 1200K holds none whole, and two hold one
# split in halves.
SMALL = "1200K"
# Offering 1340K (1.23 MB usable), none holds one whole either; once one model is split in
# halves over two agents, the other fits in thirds over all three.
SHARED = "1340K"
PROMPT = "The sea"


def _complete(agent, model_id: str) -> str:
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_models_split_over_the_same_agents_answer_as_each_served_alone(spawn_agent, tmp_path):
    llama = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama", seed=3)
    qwen = write_tiny_model(tmp_path / "tiny-qwen.gguf", "qwen2", seed=4)
    ids = ["tiny-llama", "tiny-qwen"]
    models = ["--model", str(llama), "--model", str(qwen)]

    # Each model alone, whole, on an agent of its own mesh: the answers to match.
    alone = {}
    for model_id, path in zip(ids, (llama, qwen), strict=True):
        single = spawn_agent("--model", str(path), *SETTINGS, name=f"alone-{model_id}")
        alone[model_id] = _complete(single, model_id)

    a = spawn_agent(*models, "--max-memory", SHARED, *SETTINGS, name="a", wait_model=False)
    token = invite(a)
    agents = [a] + [
        spawn_agent(
            *models, "--max-memory", SHARED, *SETTINGS, "--join", token, name=n, wait_model=False
        )
        for n in "bc"
    ]

    def routable(x) -> bool:
        placement = status(x)["placement"]
        return all(placement[m]["routable"] for m in ids)

    wait_for(lambda: all(routable(x) for x in agents), timeout=120)
    stages = {m: status(a)["placement"][m]["stages"] for m in ids}
    assert all(len(s) >= 2 for s in stages.values()), stages  # both split
    holders = [{peer for peer, *_ in s} for s in stages.values()]
    assert holders[0] & holders[1], stages  # an agent runs a stage of each

    listed = {m["id"] for m in httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"]}
    assert set(ids) <= listed
    for agent in agents:
        for model_id in ids:
            assert _complete(agent, model_id) == alone[model_id], (agent.data_dir.name, model_id)


def test_an_agent_joined_without_a_model_takes_part_in_the_mesh_s_models(spawn_agent, tmp_path):
    """The mistake a new user made: a second agent joined without --model served the
    embedded default, yet the first agent's model, too big for it alone, was split onto it;
    it never loaded its part (requests failed 30 s later saying a stage was lost). Now an
    agent without --model takes part in what the mesh's catalogue holds."""
    llama = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama", seed=3)
    a = spawn_agent(
        "--model", str(llama), "--max-memory", SMALL, *SETTINGS, name="a", wait_model=False
    )
    b = spawn_agent("--max-memory", SMALL, *SETTINGS, "--join", invite(a), name="b")
    wait_for(lambda: status(a)["placement"]["tiny-llama"]["routable"], timeout=120)
    assert len(status(a)["placement"]["tiny-llama"]["stages"]) == 2  # split over a and b
    # b seeded nothing: the mesh's catalogue had a model already.
    ids = {m["id"] for m in _models(b)}
    assert ids == {"tiny-llama"}, ids
    assert "SmolLM2-135M-Instruct.Q4_1" not in status(b)["placement"]
    assert _complete(b, "tiny-llama") == _complete(a, "tiny-llama")


def _models(agent) -> list[dict]:
    return httpx.get(f"{agent.url}/v1/models", timeout=10).json()["data"]
