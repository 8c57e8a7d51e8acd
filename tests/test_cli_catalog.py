"""`meshagent models add|remove|catalog` against the running agent of a data dir (here a fake
agent that records what it was asked): the key sent, a path made absolute, the agent's
answer printed, its error said as it is."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshagent.cli.main import main

ENTRY = {
    "name": "tiny-llama",
    "op": "add",
    "version": 1,
    "author": "abcdefghijklmnopqrstuvwxyz",
    "added_at": 1_700_000_000,
    "source": "/models/tiny-llama.gguf",
    "sha256": "ab" * 32,
    "size": 3 << 20,
    "architecture": "llama",
    "layers": 6,
    "splittable": True,
}


class FakeAgent:
    """An HTTP server that answers the catalogue's routes and records each request."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, dict[str, str], Any]] = []
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                agent.asked.append((self.command, self.path, dict(self.headers), body))
                status, reply = agent.reply(self.command, self.path)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def reply(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        if (method, path) == ("POST", "/control/models"):
            return 200, ENTRY
        if (method, path) == ("GET", "/control/models"):
            return 200, {"models": [ENTRY]}
        if (method, path) == ("DELETE", "/control/models/tiny-llama"):
            return 200, {**ENTRY, "op": "remove", "version": 2}
        error = {"message": "The model 'other' is not in the mesh's catalogue.", "code": "x"}
        return 404, {"error": error}


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAgent]:
    fake = FakeAgent()
    (tmp_path / "agent.json").write_text(json.dumps({"api": fake.url}))
    monkeypatch.setenv("MESHAGENT_API_KEY", "sekrit")
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def test_add_sends_a_path_absolute_with_the_key(agent, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["models", "add", "./tiny-llama.gguf", "--data-dir", str(tmp_path)]) == 0
    method, path, headers, body = agent.asked[-1]
    assert (method, path) == ("POST", "/control/models")
    assert body == {"model": str(tmp_path / "tiny-llama.gguf")}
    assert headers["authorization"] == "Bearer sekrit"
    out = capsys.readouterr().out
    assert "added tiny-llama to the mesh's catalogue (3.15 MB, 6 layers" in out


def test_add_sends_a_hub_name_as_it_is(agent, tmp_path, capsys):
    args = ["models", "add", "org/repo:Q4_K_M", "--json", "--data-dir", str(tmp_path)]
    assert main(args) == 0
    assert agent.asked[-1][3] == {"model": "org/repo:Q4_K_M"}
    assert json.loads(capsys.readouterr().out) == ENTRY


def test_catalog_lists_what_the_agent_answers(agent, tmp_path, capsys):
    assert main(["models", "catalog", "--data-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SIZE", "LAYERS", "SHA256"]
    assert lines[1].startswith("tiny-llama") and "/models/tiny-llama.gguf" in lines[1]
    assert main(["models", "catalog", "--json", "--data-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"models": [ENTRY]}


def test_remove_says_what_the_agent_did_or_why_not(agent, tmp_path, capsys):
    assert main(["models", "remove", "tiny-llama", "--data-dir", str(tmp_path)]) == 0
    assert agent.asked[-1][:2] == ("DELETE", "/control/models/tiny-llama")
    assert "removed tiny-llama from the mesh's catalogue (version 2)" in capsys.readouterr().out
    assert main(["models", "remove", "other", "--data-dir", str(tmp_path)]) == 1
    assert "not in the mesh's catalogue" in capsys.readouterr().err


def test_without_a_running_agent_each_says_so(tmp_path, capsys):
    for args in (["add", "x.gguf"], ["remove", "x"], ["catalog"]):
        assert main(["models", *args, "--data-dir", str(tmp_path)]) == 1
        assert "no agent is running" in capsys.readouterr().err


def test_an_empty_catalogue_says_how_to_add_one():
    from meshagent.cli.catalog import table

    assert "meshagent models add" in table([])
