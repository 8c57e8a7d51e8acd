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
    assert json.loads((b.data_dir / "agent.json").read_text())["peer_id"] == st_b["peer_id"]
    # Restarted with a plain `up` (no invite, no --peer, no mDNS on loopback), b is in the
    # same mesh and dials a again: its data dir remembers the peers it has known.
    b.stop()
    known = json.loads((b.data_dir / "known.json").read_text())
    assert [p["peer_id"] for p in known["peers"]] == [st_a["peer_id"]]
    assert known["bootstrap"] == st_a["advertised"]
    b = spawn_agent(name="b")
    assert status(b)["mesh"] == st_a["mesh"]
    wait_for(lambda: [p["peer_id"] for p in status(b)["peers"]] == [st_a["peer_id"]])
    assert status(b)["alone"] is None


def test_invite_carries_what_the_agent_advertises(spawn_agent):
    from meshagent.identity.mesh import decode_invite

    a = spawn_agent("--address", "203.0.113.7:9338", name="a")
    advertised = status(a)["advertised"]
    assert advertised[0] == "203.0.113.7:9338" and advertised[1:] == status(a)["listen"]
    assert decode_invite(invite(a)).bootstrap == tuple(advertised)


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
