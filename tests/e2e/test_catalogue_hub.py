"""A hub model added to the mesh's catalogue on one agent: an agent that has no file of it
takes part all the same, from its header alone (downloaded from the hub), and the mesh
serves it split over both agents with the text of the model served whole."""

from __future__ import annotations

import httpx
import pytest

from meshagent.launch import start_agent
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import invite, status, wait_for
from tests.e2e.test_split_serving import WHOLE
from tests.models.fake_hub import FakeHub

NAME = "org/smol-GGUF:Q4_1"
HUB_FILE = "smol-hub-Q4_1.gguf"  # catalogued as "smol-hub-Q4_1"
PROMPT = "The three longest rivers in Europe are"
# Too little for the model whole (its weights and KV cache), enough for it split over two.
HALF = ["--max-memory", "110M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]


@pytest.fixture
def hub(model_path):
    server = FakeHub({"org/smol-GGUF": {HUB_FILE: model_path.read_bytes()}})
    yield server
    server.close()


def _complete(agent, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_agent_without_the_file_takes_part_in_a_hub_model_from_its_header(
    hub, spawn_agent, tmp_path, monkeypatch
):
    model = HUB_FILE.removesuffix(".gguf")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    # The reference: the model whole, on an agent of its own (its own hub cache).
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache-ref"))
    ref = start_agent(tmp_path / "ref", *WHOLE, "--model", NAME, timeout=120)
    try:
        expected = _complete(ref, model)
    finally:
        ref.stop()

    # a pins a tiny model it is started with, and adds the hub model (downloading it whole
    # into its cache); b, with a cache of its own, has no file of it.
    tiny = write_tiny_model(tmp_path / "tiny-random.gguf", "llama", seed=3)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache-a"))
    a = spawn_agent(*HALF, "--model", str(tiny), name="a")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache-b"))
    b = spawn_agent(*HALF, "--join", invite(a), name="b", wait_model=False)
    r = httpx.post(f"{a.url}/control/models", json={"model": NAME}, timeout=300)
    assert r.status_code == 200, r.text

    def takes_part() -> bool:
        return any(m["model"] == model and m["here"] for m in status(b)["assignment"])

    wait_for(takes_part, timeout=120)
    assert "catalog.header_fetched" in b.log_text()
    assert not list((tmp_path / "cache-b").rglob("*.gguf"))  # no whole file on b

    # Too big for either alone (110 MB each): asked for, it is split over a and b, and b
    # gets its stage's layers (from a, which holds the file) without the whole file.
    assert _complete(b, model) == expected
    stages = status(a)["placement"][model]["stages"]
    assert {peer for peer, *_ in stages} == {status(a)["peer_id"], status(b)["peer_id"]}
