"""Four agent processes, each too small for the model and two enough for a split, asked for
two chains (`--chains 2`): the mesh serves the model as two chains of two stages, each the
whole model over agents of its own, and both give the same greedy text; when a stage of one
chain is killed (no spare is left to repair it), the other chain serves on and the requests
of the lost chain's entry go to it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from tests.e2e.agents import complete, invite, status, wait_for

# SmolLM2 with 2 slots of 1024 tokens needs ~145 MB: no agent offering 120 MB holds it
# whole, two do.
ARGS = ["--max-memory", "120M", "--slots", "2", "--ctx-size", "1024", "--threads", "1"]
PROMPT = "The capital of France is"


def _placement(agent, model_id: str) -> dict:
    return status(agent)["placement"][model_id]


def _served_by(agent, model_id: str) -> str:
    """The stages that served a greedy completion asked at `agent` (its receipt)."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-meshagent-stages"]


def test_two_chains_serve_the_same_text_and_one_serves_on_when_the_other_loses_a_stage(
    spawn_agent,
):
    a = spawn_agent(*ARGS, "--chains", "2", name="a", wait_model=False)
    token = invite(a)
    agents = [a] + [
        spawn_agent(*ARGS, "--chains", "2", "--join", token, name=n, wait_model=False)
        for n in "bcd"
    ]
    model_id = httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def two_chains() -> bool:
        p = [_placement(x, model_id) for x in agents]
        return all(q["routable"] and len(q["chains"]) == 1 and q["loading"] == [] for q in p)

    wait_for(two_chains, timeout=180)
    p = _placement(a, model_id)
    first, second = p["stages"], p["chains"][0]
    assert len(first) == len(second) == 2  # each chain the whole model, over two agents
    ids = {status(x)["peer_id"]: x for x in agents}
    assert {s[0] for s in first} | {s[0] for s in second} == set(ids)
    entries = [ids[first[0][0]], ids[second[0][0]]]
    shown = subprocess.run(
        [sys.executable, "-m", "meshagent", "status", "--data-dir", str(a.data_dir)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert sum(line.startswith("split ") for line in shown.splitlines()) == 2, shown
    # Each entry serves its own chain; the same greedy text either way, plain or streamed.
    texts = {s: [complete(e, model_id, PROMPT, s) for e in entries] for s in (False, True)}
    assert texts[False][0] and texts[False] == [texts[False][0]] * 2
    assert texts[True] == texts[False]
    receipts = [_served_by(e, model_id) for e in entries]
    assert receipts[0] != receipts[1]
    assert first[0][0] in receipts[0] and second[0][0] in receipts[1]

    # The second chain's last stage dies: nothing is left to repair it with, so that chain
    # goes and the first serves every request, the lost chain's entry's too.
    victim = ids[second[1][0]]
    os.kill(victim.proc.pid, signal.SIGKILL)
    rest = [x for x in agents if x is not victim]
    wait_for(
        lambda: all((q := _placement(x, model_id))["routable"] and q["chains"] == [] for x in rest),
        timeout=60,
    )
    assert _placement(a, model_id)["stages"] == first
    for x in rest:
        assert complete(x, model_id, PROMPT, True) == texts[True][0]
    assert first[0][0] in _served_by(entries[1], model_id)
