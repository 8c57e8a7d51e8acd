"""An agent started with --api-key: every endpoint but /health needs the key (the official
client works with it), a foreign Host or Origin is refused on loopback, a POST body must be
JSON, a member of the mesh reaches inference only (over `gen/1`, where no key is asked),
`meshagent status` finds the key, and an API beyond loopback without a key is refused at
start."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio
from openai import OpenAI

from meshagent.api import gen_messages as gm
from meshagent.api.gen_stream import frames, read_message
from meshagent.cli.main import main
from meshagent.launch import AgentProcess
from meshagent.serving.directory import GENERATE_LABEL
from meshagent.serving.generation import Delta, Finished
from meshagent.testing.member import AgentAddress, Member

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

    _pages_of_other_sites_are_refused(agent)
    trio.run(_peers_reach_inference_only, agent, model_id)

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


def _pages_of_other_sites_are_refused(agent: AgentProcess) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}]}
    page = {**auth, "origin": "http://evil.example"}
    r = httpx.post(f"{agent.url}/v1/chat/completions", json=chat, headers=page, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    text = {**auth, "content-type": "text/plain"}
    r = httpx.post(f"{agent.url}/control/probe", content=b"{}", headers=text, timeout=10)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    own = {**auth, "origin": agent.url}
    assert httpx.get(f"{agent.url}/control/status", headers=own, timeout=10).status_code == 200


async def _peers_reach_inference_only(agent: AgentProcess, model_id: str) -> None:
    """A member of the mesh (its secret, an identity of its own, no API key) over `gen/1`."""

    async def ask(member: Member, path: str, body: dict) -> list[gm.Message]:
        stream = await member.open(GENERATE_LABEL)
        got: list[gm.Message] = []
        async with stream:
            await stream.send_all(gm.encode(gm.Ask("POST", path, json.dumps(body).encode())))
            reader = frames()
            while not got or not isinstance(got[-1], gm.Fail | Finished):
                got.append(await read_message(stream, reader))
        return got

    with trio.fail_after(120):
        async with Member.join(AgentAddress.of(agent.data_dir)) as member:
            for path in ("/control/status", "/control/peers", "/metrics", "/control/probe"):
                body = {"peer": agent.data_dir.name, "bytes": 1 << 20}
                [fail] = await ask(member, path, body)
                assert isinstance(fail, gm.Fail) and fail.error.status == 404, (path, fail)
                assert fail.error.code == "unknown_url"
            hi = [{"role": "user", "content": "Hi"}]
            chat = {"model": model_id, "messages": hi, "max_tokens": 4}
            head, *deltas, done = await ask(member, "/v1/chat/completions", chat)
            assert isinstance(head, gm.Head) and isinstance(done, Finished), (head, done)
            assert "".join(d.text for d in deltas if isinstance(d, Delta))
