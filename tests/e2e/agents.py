"""Helpers for tests that drive real agent processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from meshagent.launch import AgentProcess
from meshagent.sse_client import completion_text, iter_events


def status(agent: AgentProcess) -> dict:
    return httpx.get(f"{agent.url}/control/status", timeout=10).json()


def wait_for(pred: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll `pred` until it is true; an agent not answering yet counts as not yet, and so does
    a status without the model asked about (an agent takes part in a model once the mesh's
    catalogue reached it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (httpx.HTTPError, KeyError):
            pass
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def invite(agent: AgentProcess) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(agent.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stdout.strip()


def complete(agent: AgentProcess, model_id: str, prompt: str, stream: bool) -> str:
    """A greedy 12-token completion of `prompt`: its text, assembled from the stream if
    streamed."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    if not stream:
        r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with httpx.stream(
        "POST", f"{agent.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        return completion_text(iter_events(r))


def spawn_mesh(spawn_agent: Callable[..., AgentProcess], *args: str) -> list[AgentProcess]:
    """Three agents started with `args`, the second and third joining the first's mesh by
    its invite (not waiting for a model: one may be served nowhere yet)."""
    a = spawn_agent(*args, name="a", wait_model=False)
    token = invite(a)
    b = spawn_agent(*args, "--join", token, name="b", wait_model=False)
    c = spawn_agent(*args, "--join", token, name="c", wait_model=False)
    return [a, b, c]


def answers_as_whole(whole: AgentProcess, agents: list[AgentProcess], model_id: str, prompt: str):
    """Every agent's greedy completion of `prompt`, plain and streamed, is the one `whole`
    gives (which is not empty, and the same either way)."""
    expected = {s: complete(whole, model_id, prompt, s) for s in (False, True)}
    assert expected[False] == expected[True] and expected[False]
    for x in agents:
        for s in (False, True):
            assert complete(x, model_id, prompt, s) == expected[s], (x.data_dir.name, s)


def stop_together(agents: list[AgentProcess]) -> list[str]:
    """Stop `agents` at once, as the `spawn_agent` fixture does; each must exit cleanly. The
    log lines where a connection waited out its drain grace for a stream left open (a
    stopping agent should end every stream it serves or holds instead)."""
    for agent in agents:
        agent.proc.terminate()
    codes = [agent.wait_stopped() for agent in agents]
    assert codes == [0] * len(agents), codes
    return [
        line
        for agent in agents
        for line in agent.log_text().splitlines()
        if '"conn.drain_expired"' in line
    ]
