"""Many models on one mesh, as ollama's users know them: a catalogued model no agent serves
is loaded by its first request, which waits for it and gets the model's answer; it unloads
after its keep_alive (the request's own: 0 right after it, -1 never)."""

from __future__ import annotations

import time

import httpx
import pytest

from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import status, wait_for

SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
PROMPT = "The sea"


def _complete(agent, model_id: str, **extra) -> httpx.Response:
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{agent.url}/v1/completions", json=body, timeout=120)


def _loaded(agent, model_id: str) -> bool:
    placement = status(agent)["placement"].get(model_id)
    return bool(placement and placement["routable"])


def test_a_catalogued_model_loads_on_its_first_request_and_unloads_after_its_keep_alive(
    spawn_agent, tmp_path
):
    tiny = write_tiny_model(tmp_path / "tiny-cold.gguf", "llama", seed=6)
    alone = spawn_agent("--model", str(tiny), *SETTINGS, name="alone")
    expected = _complete(alone, "tiny-cold").json()["choices"][0]["text"]

    a = spawn_agent(*SETTINGS, name="a")  # a fresh mesh: the embedded default, pinned
    r = httpx.post(f"{a.url}/control/models", json={"model": str(tiny)}, timeout=60)
    assert r.status_code == 200, r.text
    wait_for(lambda: "tiny-cold" in status(a)["placement"], timeout=30)
    time.sleep(2)
    assert not _loaded(a, "tiny-cold")  # catalogued, never asked for: not loaded
    assert "not requested" in (status(a)["placement"]["tiny-cold"]["error"] or "")

    began = time.monotonic()
    r = _complete(a, "tiny-cold", keep_alive=0)  # unload right after this request
    took = time.monotonic() - began
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    print(f"first request to a cold model answered in {took:.2f} s")
    wait_for(lambda: not _loaded(a, "tiny-cold"), timeout=15)

    r = _complete(a, "tiny-cold", keep_alive=-1)  # kept loaded for good
    assert r.status_code == 200, r.text
    time.sleep(3)
    assert _loaded(a, "tiny-cold")
    assert _loaded(a, "SmolLM2-135M-Instruct.Q4_1")  # pinned all along

    r = _complete(a, "tiny-cold", keep_alive="soon")
    assert r.status_code == 400 and "keep_alive" in r.text


def test_keep_alive_ps_pin_and_load_timeout_through_the_ollama_client(spawn_agent, tmp_path):
    import ollama

    tiny = write_tiny_model(tmp_path / "tiny-ps.gguf", "llama", seed=7)
    big = write_tiny_model(tmp_path / "tiny-pinned.gguf", "llama", seed=8)
    # Pins a model it was not started with; a load of anything else waits at most 0.5 s.
    a = spawn_agent(
        *SETTINGS, "--pin", "tiny-pinned", "--load-timeout", "0.5", name="a", wait_model=True
    )
    client = ollama.Client(host=a.url)
    for path in (tiny, big):
        r = httpx.post(f"{a.url}/control/models", json={"model": str(path)}, timeout=60)
        assert r.status_code == 200, r.text
    wait_for(lambda: _loaded(a, "tiny-pinned"), timeout=60)  # pinned: loaded, never asked
    ps = {m.model: m for m in client.ps().models}
    assert set(ps) == {"SmolLM2-135M-Instruct.Q4_1", "tiny-pinned"}
    assert ps["tiny-pinned"].expires_at.year > 2100  # pinned: never

    # Cold, and 0.5 s is less than its load takes: a 503 saying so, with Retry-After.
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny-ps", prompt=PROMPT, options={"num_predict": 4})
    assert e.value.status_code == 503 and "did not load within 0.5 s" in e.value.error
    # That request's demand loads it all the same: the next one finds it.
    wait_for(lambda: _loaded(a, "tiny-ps"), timeout=60)
    options = {"num_predict": 4, "temperature": 0}
    out = client.generate(model="tiny-ps", prompt=PROMPT, options=options, keep_alive="1h")
    assert out.done
    ends = {m.model: m.expires_at for m in client.ps().models}["tiny-ps"]
    left = ends.timestamp() - time.time()
    assert 3500 < left <= 3600, left  # keep_alive 1h
    client.generate(model="tiny-ps", prompt=PROMPT, options={"num_predict": 2}, keep_alive=0)
    wait_for(lambda: "tiny-ps" not in {m.model for m in client.ps().models}, timeout=15)
