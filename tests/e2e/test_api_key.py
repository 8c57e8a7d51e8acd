"""An agent started with --api-key: every endpoint but /health needs the key (the official
client works with it), a foreign Host is refused on loopback, `meshagent status` finds the key,
and an API beyond loopback without a key is refused at start."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from meshagent.cli.main import main

KEY = "test-key-7f3a"


def test_every_endpoint_but_health_needs_the_key(spawn_agent, model_id, monkeypatch, capsys):
    agent = spawn_agent("--api-key", KEY, "--slots", "1", "--ctx-size", "512", "--threads", "1")
    assert httpx.get(f"{agent.url}/health", timeout=10).status_code == 200
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("GET", "/control/status"),
        ("GET", "/control/peers"),
        ("POST", "/control/probe"),
    ):
        r = httpx.request(method, f"{agent.url}{path}", json={}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{agent.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=f"{agent.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content

    # DNS rebinding: a page of another site that reaches the loopback API through its own
    # name is refused, key or not.
    r = httpx.get(
        f"{agent.url}/v1/models",
        headers={"host": "attacker.example", "authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"

    # `meshagent status` says what it needs, then uses the key from the environment.
    monkeypatch.delenv("MESHAGENT_API_KEY", raising=False)
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 1
    assert "needs an API key" in capsys.readouterr().err
    monkeypatch.setenv("MESHAGENT_API_KEY", KEY)
    assert main(["status", "--data-dir", str(agent.data_dir)]) == 0
    assert "(1 key)" in capsys.readouterr().out


def test_an_api_beyond_loopback_without_a_key_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MESHAGENT_API_KEY", raising=False)
    rc = main(["up", "--data-dir", str(tmp_path), "--api-host", "0.0.0.0", "--api-port", "0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "without a key" in err and "--api-key" in err and "--insecure-no-api-key" in err
