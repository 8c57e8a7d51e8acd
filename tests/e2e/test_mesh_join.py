"""Agents join one mesh with an invite token; an agent of another mesh is refused."""

from __future__ import annotations

import json

from tests.e2e.agents import invite, status, wait_for


def test_invite_joins_a_second_agent_to_the_mesh(spawn_agent):
    a = spawn_agent(name="a")
    token = invite(a)
    assert token.startswith("meshinv1")
    b = spawn_agent("--join", token, name="b")
    st_a, st_b = status(a), status(b)
    assert st_a["mesh"] == st_b["mesh"]
    wait_for(lambda: [p["peer_id"] for p in status(b)["peers"]] == [st_a["peer_id"]])
    wait_for(lambda: [p["peer_id"] for p in status(a)["peers"]] == [st_b["peer_id"]])
    peer = status(b)["peers"][0]
    assert peer["path"] == "direct"
    assert peer["address"] == st_a["listen"][0]
    # The mesh is remembered: restarting b without --join keeps it in the same mesh.
    assert json.loads((b.data_dir / "agent.json").read_text())["peer_id"] == st_b["peer_id"]


def test_an_agent_of_another_mesh_is_refused(spawn_agent):
    a = spawn_agent(name="a")
    outsider = spawn_agent("--peer", status(a)["listen"][0], name="outsider")
    wait_for(
        lambda: "dial.refused" in outsider.log_text() or "bootstrap_failed" in outsider.log_text()
    )
    wait_for(lambda: "handshake.refused" in a.log_text())
    assert status(a)["peers"] == []
    assert status(outsider)["peers"] == []
    assert status(a)["mesh"] != status(outsider)["mesh"]
