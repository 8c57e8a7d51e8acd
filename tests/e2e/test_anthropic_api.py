"""Anthropic's Messages API on an agent serving the embedded model whole, through the official
`anthropic` client (the split: tests/e2e/test_split_serving.py)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from meshagent.launch import AgentProcess
from tests.e2e.anthropic_checks import ASK, check_messages, client_for


@pytest.fixture
def model_id(agent: AgentProcess) -> str:
    return httpx.get(f"{agent.url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_the_messages_api_through_anthropics_client(agent: AgentProcess, model_id: str) -> None:
    check_messages(agent, model_id)


def test_a_missing_max_tokens_is_an_anthropic_error(agent: AgentProcess, model_id: str) -> None:
    r = httpx.post(
        f"{agent.url}/v1/messages", json={"model": model_id, "messages": ASK}, timeout=30
    )
    assert r.status_code == 400
    missing = "Missing required parameter: 'max_tokens'."
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": missing},
    }
    # Extended thinking, which some clients ask of every model: accepted, no thinking blocks.
    thinking = {"type": "enabled", "budget_tokens": 1024}
    reply = client_for(agent).messages.create(
        model=model_id, max_tokens=5, messages=ASK, thinking=thinking
    )
    assert [b.type for b in reply.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError):
        client_for(agent).messages.create(
            model=model_id,
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],
        )
    # Anthropic's own range: a temperature of 0-1.
    r = httpx.post(
        f"{agent.url}/v1/messages",
        json={"model": model_id, "messages": ASK, "max_tokens": 5, "temperature": 1.5},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
