"""The mesh's catalogue between real agent processes: `meshagent models add` on one agent
lists the model in every agent's `/v1/models` within 3 s, `meshagent models remove` takes it
out again, and the entry each agent holds is the one its author signed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from meshagent.launch import AgentProcess
from meshagent.testing.tiny_gguf import write_tiny_model
from tests.e2e.agents import invite, status, wait_for

BOUND = 3.0  # seconds from the command's answer to every agent listing the change


def _models(agent: AgentProcess) -> dict[str, dict]:
    data = httpx.get(f"{agent.url}/v1/models", timeout=5).json()["data"]
    return {card["id"]: card["meshagent"] for card in data}


def _cli(agent: AgentProcess, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "models", *args, "--data-dir", str(agent.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def _until(pred, what: str) -> float:
    """Seconds until `pred` holds, polled every 20 ms; fails past `BOUND`."""
    start = time.monotonic()
    while not pred():
        elapsed = time.monotonic() - start
        assert elapsed < BOUND, f"{what}: not within {BOUND} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_model_added_on_one_agent_is_listed_by_the_other_and_removed_again(
    spawn_agent, tmp_path: Path
):
    a = spawn_agent(name="a")
    b = spawn_agent("--join", invite(a), name="b")
    a_id, b_id = status(a)["peer_id"], status(b)["peer_id"]
    wait_for(lambda: [p["peer_id"] for p in status(b)["peers"]] == [a_id])
    wait_for(lambda: [p["peer_id"] for p in status(a)["peers"]] == [b_id])
    tiny = write_tiny_model(tmp_path / "tiny-catalogued.gguf", "llama", seed=5)
    assert "tiny-catalogued" not in _models(b)

    began = time.monotonic()
    out = _cli(a, "add", str(tiny))
    answered = time.monotonic() - began
    assert "added tiny-catalogued to the mesh's catalogue" in out
    on_b = _until(lambda: "tiny-catalogued" in _models(b), "the add on b")
    card = _models(b)["tiny-catalogued"]
    assert (card["catalogued"], card["loaded"]) == (True, False)
    assert card["size_bytes"] == tiny.stat().st_size
    assert "tiny-catalogued" in _models(a)
    listed = httpx.get(f"{b.url}/control/models", timeout=5).json()["models"]
    # The mesh was new: a seeded its catalogue with the embedded default ("" its source).
    assert [(m["name"], m["author"], m["source"]) for m in listed] == [
        ("SmolLM2-135M-Instruct.Q4_1", a_id, ""),
        ("tiny-catalogued", a_id, str(tiny)),
    ]
    print(
        f"\nmodels add: answered in {answered:.2f} s (the CLI's start included), "
        f"listed on the other agent {on_b:.2f} s later"
    )

    began = time.monotonic()
    _cli(a, "remove", "tiny-catalogued")
    answered = time.monotonic() - began
    off_b = _until(lambda: "tiny-catalogued" not in _models(b), "the removal on b")
    assert "tiny-catalogued" not in _models(a)
    left = _cli(b, "catalog")
    assert "tiny-catalogued" not in left and "SmolLM2-135M-Instruct.Q4_1" in left
    print(
        f"models remove: answered in {answered:.2f} s, gone from the other agent "
        f"{off_b:.2f} s later"
    )
