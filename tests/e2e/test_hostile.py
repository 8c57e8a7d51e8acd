"""A hostile member of the mesh (`meshagent.testing.hostile`) against a real agent serving
the model whole: 200 generated cases on every overlay label and connection, then the agent
is still alive and serves an authorised client. bench/hostile.py runs the same member against
a split for minutes."""

from __future__ import annotations

import httpx
from structlog.testing import capture_logs

from meshagent.testing.hostile import CONNECT, LABELS, HostileMember, Knowledge
from meshagent.testing.member import AgentAddress

CASES = 200


async def test_an_agent_outlives_a_hostile_member(spawn_agent, model_id):
    agent = spawn_agent("--slots", "4", "--ctx-size", "512", "--threads", "1")
    hostile = HostileMember(
        [AgentAddress.of(agent.data_dir)], Knowledge(model=model_id, slots=4, ctx=512), seed=0
    )
    with capture_logs():  # the member's own overlay: a line per connection it opens
        tally = await hostile.run(count=CASES, rate=100, concurrency=32)

    assert tally.total >= CASES  # plus the agent's own exchanges, answered with forged items
    assert set(tally.sent) >= {*LABELS, CONNECT}, "every label was spoken"
    assert agent.proc.poll() is None, (
        f"the agent died (exit {agent.proc.poll()}); first connection lost under: "
        f"{tally.first_lost}"
    )
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = httpx.post(f"{agent.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
