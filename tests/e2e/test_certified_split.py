"""Hybrid (attention and Mamba layers) and recurrent (Mamba) models are split only once
certified: three agents too small for one serve it nowhere until one certifies it; the record
reaches the others by gossip, and the mesh splits it and serves it end to end with the whole
model's answers."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from meshagent.testing.tiny_gguf import write_tiny_jamba, write_tiny_mamba
from tests.e2e.agents import answers_as_whole, spawn_mesh, status, wait_for

# With 2 slots of 256 tokens the tiny jamba needs ~1.7 MB whole and the tiny mamba ~0.9 MB;
# with 10% headroom no agent offering 800 KB (jamba) or 400 KB (mamba) holds one, and no two
# do: it takes three stages.
SMALL = {"jamba": "800K", "mamba": "400K"}
SETTINGS = ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
PROMPT = "The sea"


@pytest.mark.parametrize("arch", ["jamba", "mamba"])
def test_a_certified_hybrid_or_recurrent_model_is_split_and_served(spawn_agent, tmp_path, arch):
    write = write_tiny_jamba if arch == "jamba" else write_tiny_mamba
    model = write(tmp_path / f"tiny-{arch}.gguf")
    model_id = f"tiny-{arch}"
    args = ["--model", str(model), "--max-memory", SMALL[arch], *SETTINGS]
    agents = spawn_mesh(spawn_agent, *args)
    a, b = agents[0], agents[1]

    def placement(x):
        return status(x)["placement"][model_id]

    # Not certified: it may not be split, and it fits no one agent; status says so.
    wait_for(lambda: "certified" in (placement(b)["error"] or ""), timeout=60)
    assert not placement(b)["routable"]

    # a certifies it (while running, from its own data dir); b and c never do.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "meshagent",
            "models",
            "certify",
            str(model),
            "--data-dir",
            str(a.data_dir),
            "--tokens",
            "4",
            "--ctx-size",
            "128",
            "--threads",
            "1",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    wait_for(lambda: all(placement(x)["routable"] for x in agents), timeout=120)
    plan = placement(b)
    assert len(plan["stages"]) == 3
    # b plans with the record it heard by gossip, keeps it, and says it is certified.
    assert plan["wire"]["certified_exact"] is True, plan["wire"]
    assert list((b.data_dir / "artifacts" / "capabilities").glob("*.cbor"))
    whole = spawn_agent(*SETTINGS, "--model", str(model), name="whole")
    answers_as_whole(whole, agents, model_id, PROMPT)
    if arch == "jamba":
        drafts_and_kept_prefixes_change_no_token(whole, b, model_id)


def _greedy(agent, model_id: str, prompt: str, max_tokens: int, speculation: str) -> dict:
    body = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "meshagent": {"speculation": speculation},
    }
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def drafts_and_kept_prefixes_change_no_token(whole, split, model_id: str) -> None:
    """A hybrid's recurrent state is cut back from a checkpoint when drafts are rejected, and
    kept at a prefix's end for prompts that hold all of it: with drafts on and a kept prefix,
    the whole model and the split give the text of plain decoding from scratch."""
    head = "A river runs down to the sea, past the mill and the bridge. "
    tail = "The boat goes on"
    plain = _greedy(whole, model_id, head + tail, 120, "off")
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for agent in (whole, split):
        # A one-token request leaves its prompt's state kept; the next prompt holds it all.
        seeded = _greedy(agent, model_id, head, 1, "off")
        r = _greedy(agent, model_id, head + tail, 120, "on")
        assert r["choices"][0]["text"] == plain["choices"][0]["text"], agent.data_dir.name
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == seeded["usage"]["prompt_tokens"], agent.data_dir.name
        # Drafts were accepted, and some rejected: cut back from the checkpoints.
        receipt = r["usage"]["meshagent"]["speculation"]
        assert 0 < receipt["accepted"] < receipt["drafted"], receipt
