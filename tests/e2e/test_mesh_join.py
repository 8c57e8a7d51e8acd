"""Agents join one mesh with an invite token; an agent of another mesh is refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx


def _status(agent) -> dict:
    return httpx.get(f"{agent.url}/control/status").json()


def _wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _invite(agent) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(agent.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return r.stdout.strip()


def test_invite_joins_a_second_agent_to_the_mesh(spawn_agent):
    a = spawn_agent(name="a")
    token = _invite(a)
    assert token.startswith("meshinv1")
    b = spawn_agent("--join", token, name="b")
    st_a, st_b = _status(a), _status(b)
    assert st_a["mesh"] == st_b["mesh"]
    _wait_for(lambda: [p["peer_id"] for p in _status(b)["peers"]] == [st_a["peer_id"]])
    _wait_for(lambda: [p["peer_id"] for p in _status(a)["peers"]] == [st_b["peer_id"]])
    peer = _status(b)["peers"][0]
    assert peer["path"] == "direct"
    assert peer["address"] == st_a["listen"][0]
    # The mesh is remembered: restarting b without --join keeps it in the same mesh.
    assert json.loads((b.data_dir / "agent.json").read_text())["peer_id"] == st_b["peer_id"]


def test_an_agent_of_another_mesh_is_refused(spawn_agent):
    a = spawn_agent(name="a")
    outsider = spawn_agent("--peer", _status(a)["listen"][0], name="outsider")
    _wait_for(
        lambda: "dial.refused" in outsider.log_text() or "bootstrap_failed" in outsider.log_text()
    )
    _wait_for(lambda: "handshake.refused" in a.log_text())
    assert _status(a)["peers"] == []
    assert _status(outsider)["peers"] == []
    assert _status(a)["mesh"] != _status(outsider)["mesh"]
