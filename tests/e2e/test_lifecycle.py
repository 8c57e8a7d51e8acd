"""Queue bounds, shutdown with streams in flight, and curl as a streaming client."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading

import httpx
import openai
import pytest
from openai import OpenAI

from meshagent.launch import AgentProcess
from meshagent.sse_client import EventDecoder, iter_events
from tests.e2e.agents import status, wait_for

COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy decoding keeps counting until max_tokens


def _stream_completion(
    url: str, model_id: str, max_tokens: int, started: threading.Event, out: dict, key: int
) -> None:
    """Stream a counting completion; record every data event in out[key]."""
    body = {
        "model": model_id,
        "prompt": COUNTING,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    events: list = []
    out[key] = events
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out[f"status{key}"] = r.status_code
        for event in iter_events(r):
            events.append(event.data if event.done else event.json())
            started.set()


def test_queue_bound_answers_429(spawn_agent, model_id: str) -> None:
    agent = spawn_agent("--slots", "1", "--max-queue", "1")
    out: dict = {}
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_stream_completion, args=(agent.url, model_id, 200, ev, out, i))
        for i, ev in enumerate(started)
    ]
    threads[0].start()
    assert started[0].wait(60)
    threads[1].start()
    wait_for(lambda: status(agent)["models"][0]["slots"]["queued"] == 1)
    client = OpenAI(base_url=f"{agent.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model=model_id, prompt="hi", max_tokens=4)
    assert exc.value.status_code == 429
    assert exc.value.body["code"] == "rate_limit_exceeded"
    for t in threads:
        t.join(120)
    # Neither the running nor the queued request was dropped.
    for i in (0, 1):
        assert out[i][-1] == "[DONE]"
        assert out[i][-2]["choices"][0]["finish_reason"] == "length"


def _refused(agent: AgentProcess) -> bool:
    try:
        return httpx.get(f"{agent.url}/health").status_code == 503
    except httpx.ConnectError:
        return True


def _start_streams(agent: AgentProcess, model_id: str, n: int, max_tokens: int):
    out: dict = {}
    started = [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(
            target=_stream_completion, args=(agent.url, model_id, max_tokens, ev, out, i)
        )
        for i, ev in enumerate(started)
    ]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60)
    return out, threads


def test_sigint_lets_running_streams_finish(spawn_agent, model_id: str) -> None:
    agent = spawn_agent("--grace", "60")
    out, threads = _start_streams(agent, model_id, 4, max_tokens=120)
    agent.proc.send_signal(signal.SIGINT)
    # While draining, new work is refused: the listener is closed.
    wait_for(lambda: _refused(agent), timeout=10)
    for t in threads:
        t.join(120)
    for i in range(4):
        events = out[i]
        assert events[-1] == "[DONE]", events[-3:]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert len(text) > 100
    assert agent.proc.wait(30) == 0


def test_sigint_grace_expiry_ends_streams_with_an_error(spawn_agent, model_id: str) -> None:
    agent = spawn_agent("--grace", "1")
    out, threads = _start_streams(agent, model_id, 4, max_tokens=1800)
    agent.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(60)
    for i in range(4):
        last = out[i][-1]
        assert isinstance(last, dict) and "error" in last, out[i][-2:]
        assert last["error"]["code"] == "shutting_down"
        assert last["error"]["type"] == "server_error"
    assert agent.proc.wait(30) == 0
    assert "shutdown.grace_expired" in agent.log_text()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_tokens_as_they_come(spawn_agent, model_id: str) -> None:
    agent = spawn_agent()
    body = json.dumps(
        {"model": model_id, "prompt": COUNTING, "max_tokens": 200, "temperature": 0, "stream": True}
    )
    proc = subprocess.Popen(
        [
            "curl",
            "-sN",
            f"{agent.url}/v1/completions",
            "-H",
            "content-type: application/json",
            "-d",
            body,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = ""
    while not first.startswith("data: "):
        first = proc.stdout.readline()
    # curl printed a token while the agent is still generating the rest.
    assert status(agent)["in_flight"] == 1
    rest = proc.stdout.read()
    assert proc.wait(60) == 0
    events = EventDecoder().feed((first + rest).encode())
    assert events[-1].done
    assert len(events) > 100
