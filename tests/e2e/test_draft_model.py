"""An agent serving a model whole with a draft model (`--draft-model`): speculating requests
verify the draft model's proposals and the text is plain decoding's; the draft model's memory
comes out of what the agent offers the mesh, and its compute is in the agent's record."""

from __future__ import annotations

import subprocess
import sys

import httpx

from meshagent.advertisement import draft_compute, draft_model_bytes
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import invite, wait_for
from tests.e2e.test_console import _browser

SETTINGS = ["--slots", "2", "--ctx-size", "512", "--threads", "1", "--max-memory", "2G"]


def _ask(agent, model_id: str, mode: str) -> dict:
    """A greedy completion of 48 tokens with speculation `mode`."""
    body = {
        "model": model_id,
        "prompt": "Once upon a time, in a small village by the sea,",
        "max_tokens": 48,
        "temperature": 0,
        "meshagent": {"speculation": mode},
    }
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_draft_model_drafts_for_the_model_served_whole(spawn_agent, model_path, model_id):
    plain_agent = spawn_agent(*SETTINGS, name="plain")
    agent = spawn_agent(*SETTINGS, "--draft-model", str(model_path), name="drafts")

    plain, spec = _ask(agent, model_id, "off"), _ask(agent, model_id, "on")
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert len(plain["choices"][0]["text"]) > 60
    receipt = spec["usage"]["meshagent"]["speculation"]
    # SmolLM2 drafting for itself: the draft model knows the text, not only its copies.
    assert receipt["accepted"] >= 30 and receipt["accepted"] > 0.8 * receipt["drafted"]
    by_model = receipt["draft_model"]
    assert by_model["name"] == model_id and 1 <= by_model["windows"] <= receipt["windows"]
    assert 0 < by_model["accepted"] <= by_model["drafted"] <= receipt["drafted"]
    # The status names it, with what a forward pass of it took and what it accepted.
    [served] = httpx.get(f"{agent.url}/control/status", timeout=10).json()["models"]
    draft = served["speculation"]["draft_model"]
    assert draft["name"] == model_id and draft["forward_ms"] > 0
    # Served whole, it reads the text when asked for a proposal (its prompt first), never
    # ahead: that is a split's entry's, while its windows travel.
    assert draft["read_when_asked"]["tokens"] >= 10 and draft["read_when_asked"]["ms"] > 0
    assert draft["read_ahead"] == {"tokens": 0, "ms": 0.0}
    assert draft["right"] == {"p": None, "judged": 0.0}  # ("on" sends, "auto" judges)
    assert served["slots"]["model_accepted"] >= by_model["accepted"]
    shown = subprocess.run(
        [sys.executable, "-m", "meshagent", "status", "--data-dir", str(agent.data_dir)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f"draft     {model_id}: " in shown and "draft tokens accepted" in shown
    # And the console, in a browser: the drafts accepted, and the draft model's.
    chromium = _browser()
    from playwright.sync_api import expect, sync_playwright

    slots = served["slots"]
    want = f"{slots['draft_accepted']} of {slots['draft_tokens']} ("
    want_model = f"; {model_id}: {slots['model_accepted']} of {slots['model_tokens']} ("
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{agent.url}/console")
            cell = page.locator("#models td.drafts")
            expect(cell).to_contain_text(want, timeout=15_000)
            expect(cell).to_contain_text(want_model)
        finally:
            browser.close()

    def record(a) -> dict:
        peers = httpx.get(f"{a.url}/control/peers", timeout=10).json()["peers"]
        return next(p for p in peers if p["self"])

    def offered(a) -> int:
        return record(a)["mem_weights_bytes"] + record(a)["mem_kv_bytes"]

    need = draft_model_bytes(model_path, 2 * 512)
    assert offered(plain_agent) - offered(agent) == need
    # Its compute is in its record too, for placement to count at the entry: a model named
    # drafts for every target.
    gflops, every = draft_compute(model_path, auto=False)
    assert record(agent)["draft_gflops"] == [gflops, every] and 0.2 < gflops < 0.3
    assert record(plain_agent)["draft_gflops"] == [0.0, 0.0]


def test_a_splits_entry_drafts_with_its_draft_model(spawn_agent, model_path, model_id):
    # Two agents, each given the draft model: what it takes comes out of each offer (224 MB
    # for SmolLM2 at 2 x 512 tokens), and what is left (130 MB) holds half the model, not
    # all of it: the model is split in two, and the entry's draft model proposes windows
    # that the split verifies. The text is the whole model's without drafts.
    need = draft_model_bytes(model_path, 2 * 512)
    small = [*SETTINGS[:-2], "--max-memory", str(need + 130_000_000)]
    a = spawn_agent(*small, "--draft-model", str(model_path), name="a", wait_model=False)
    b = spawn_agent(*small, "--draft-model", str(model_path), "--join", invite(a), name="b",
                    wait_model=False)  # fmt: skip

    def split() -> bool:
        p = httpx.get(f"{a.url}/control/status", timeout=10).json()["placement"][model_id]
        return p["routable"] and len(p["stages"]) == 2

    wait_for(split, timeout=120)

    plain, spec = _ask(a, model_id, "off"), _ask(b, model_id, "on")
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    receipt = spec["usage"]["meshagent"]["speculation"]
    by_model = receipt["draft_model"]
    assert by_model["name"] == model_id and by_model["windows"] >= 1
    assert by_model["accepted"] >= 30, receipt
    assert by_model["accepted"] > 0.8 * by_model["drafted"]


def test_auto_drafts_with_a_catalogued_model_of_the_targets_vocabulary(spawn_agent, tmp_path):
    # Two models of one vocabulary in the catalogue, one under a sixth of the other's size:
    # `auto` has the small one draft for the big one token for token, and none for itself
    # (nothing catalogued is small enough, and it is not six embedded draft models big).
    big = write_tiny_model(tmp_path / "tiny-big.gguf", "llama", n_embd=256, n_ff=1024, seed=5)
    small = write_tiny_model(tmp_path / "tiny-small.gguf", "llama", n_embd=32, n_ff=64, seed=6)
    agent = spawn_agent(
        *SETTINGS, "--model", str(big), "--model", str(small), "--draft-model", "auto"
    )
    served: dict = {}

    def both_served() -> bool:
        models = httpx.get(f"{agent.url}/control/status", timeout=10).json()["models"]
        served.update({m["id"]: m for m in models})
        return {"tiny-big", "tiny-small"} <= set(served)

    wait_for(both_served, timeout=60)
    assert served["tiny-big"]["speculation"]["draft_model"]["name"] == "tiny-small"
    assert served["tiny-small"]["speculation"].get("draft_model") is None
    plain, spec = _ask(agent, "tiny-big", "off"), _ask(agent, "tiny-big", "on")
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    by_model = spec["usage"]["meshagent"]["speculation"]["draft_model"]
    assert by_model["name"] == "tiny-small" and by_model["windows"] >= 1
