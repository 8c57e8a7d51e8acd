"""Three agent processes, each too small for the model, negotiate a split and serve it."""

from __future__ import annotations

import httpx
import pytest

from meshagent.engine.llama import LlamaEngine
from meshagent.serving.chat import ChatMessage, ChatTemplate
from tests.e2e.agents import invite, wait_for

# SmolLM2 with 2 slots of 1024 tokens needs ~145 MB (weights + KV); with 10% headroom no
# agent offering 80 MB can hold it, two cannot either, three can.
SMALL = ["--max-memory", "80M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]
PROMPT = "Name three rivers in Europe."


def _get(agent, path):
    return httpx.get(f"{agent.url}{path}", timeout=10).json()


def _chat(agent, model_id):
    r = httpx.post(
        f"{agent.url}/v1/chat/completions",
        json={
            "model": model_id,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 32,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def reference(model_path):
    # As the agents: flash attention off, one thread.
    engine = LlamaEngine(model_path, slots=1, slot_ctx=512, threads=1)
    try:
        import numpy as np

        from meshagent.engine.base import ForwardItem

        t = ChatTemplate(
            engine.info.chat_template,
            bos_token=engine.info.bos_token,
            eos_token=engine.info.eos_token,
        )
        tokens = engine.tokenize(t.render([ChatMessage("user", PROMPT)]), add_bos=False)
        out = b""
        logits = engine.forward([ForwardItem(0, 0, tokens, True)])[0]
        pos = len(tokens)
        for _ in range(32):
            tok = int(np.argmax(logits))
            if engine.is_end_of_generation(tok):
                break
            out += engine.token_bytes(tok)
            logits = engine.forward([ForwardItem(0, pos, [tok], True)])[0]
            pos += 1
        return out.decode("utf-8", errors="replace")
    finally:
        engine.close()


def test_three_small_agents_serve_a_split(spawn_agent, model_id, reference):
    a = spawn_agent(*SMALL, "--wire-dtype", "f32", name="a", wait_model=False)
    token = invite(a)
    b = spawn_agent(*SMALL, "--wire-dtype", "f32", "--join", token, name="b", wait_model=False)
    c = spawn_agent(*SMALL, "--wire-dtype", "f32", "--join", token, name="c", wait_model=False)
    agents = [a, b, c]

    def routable():
        return all(_get(x, "/control/status")["placement"][model_id]["routable"] for x in agents)

    wait_for(routable, timeout=120)
    placement = _get(a, "/control/status")["placement"][model_id]
    assert len(placement["stages"]) == 3
    ids = {_get(x, "/control/status")["peer_id"] for x in agents}
    assert {s[0] for s in placement["stages"]} == ids
    # A request to any of the three agents is served by the split, with a receipt.
    for x in agents:
        try:
            r = _chat(x, model_id)
        except AssertionError:
            for y in agents:
                print("----", y.data_dir.name)
                print(
                    "\n".join(
                        line
                        for line in y.log_text().splitlines()
                        if any(
                            k in line
                            for k in (
                                "placement.",
                                "mesh_model",
                                "split.",
                                "stage.",
                                "handler_",
                                "pipeline.",
                                "conn.closed",
                            )
                        )
                    )
                )
            raise
        assert r.json()["choices"][0]["message"]["content"] == reference
        stages = r.headers["x-meshagent-stages"].split(",")
        assert len(stages) == 3
        # The receipt: which peers ran which layers (header), time in each stage (usage).
        stage_ms = r.json()["usage"]["meshagent"]["stage_ms"]
        assert len(stage_ms) == 3 and all(ms > 0 for ms in stage_ms)
        assert r.headers["x-meshagent-wire-dtype"] == "f32"

    # c dies; a fourth agent with room for the whole model joins: the mesh replans.
    c.proc.kill()
    d = spawn_agent(
        "--max-memory",
        "1G",
        "--slots",
        "2",
        "--ctx-size",
        "1024",
        "--threads",
        "1",
        "--join",
        token,
        name="d",
    )
    d_id = _get(d, "/control/status")["peer_id"]

    def moved():
        p = _get(a, "/control/status")["placement"][model_id]
        return p["routable"] and p["replicas"] == [d_id]

    wait_for(moved, timeout=120)
    r = _chat(a, model_id)
    assert r.headers["x-meshagent-served-by"] == d_id
    assert r.json()["choices"][0]["message"]["content"]
