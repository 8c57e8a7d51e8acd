"""Acceptance 1, 3 and 4: agents in separate network namespaces on one bridge find each other
by mDNS alone, ignore an agent of another mesh, detect a kill -9 and take a restart back."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from meshagent.identity.mesh import MeshSecret
from meshagent.identity.mesh_file import save_mesh
from tests.e2e.netns import Lab, NsProcess, require_netns, wait_until

pytestmark = pytest.mark.slow

DISCOVERY_BOUND_S = 10.0
SECRET = MeshSecret(os.urandom(32))


def _logged_at(agent: NsProcess, event: str, peer: str = "") -> datetime:
    """When `agent` first logged `event` (about `peer`, if given), by its own clock."""
    for line in agent.log_text().splitlines():
        if f'"{event}"' in line and peer in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00"))
    raise AssertionError(f"no {event} {peer} in {agent.log_path}")


def _dead_at(agent: NsProcess, peer: str) -> datetime:
    return _logged_at(agent, "gossip.peer_dead", peer)


def _alive(body: dict) -> set[str]:
    return {p["peer_id"] for p in body["peers"] if p["state"] == "alive"}


class Lan:
    def __init__(self, lab: Lab, root: Path) -> None:
        self.lab = lab
        self.root = root
        self.bridge = lab.bridge()
        self.hosts: dict[str, str] = {}
        self.agents: dict[str, NsProcess] = {}

    def host(self, name: str, ip: str) -> str:
        ns = self.lab.ns(name)
        self.lab.attach(ns, self.bridge, f"{ip}/24")
        self.hosts[name] = ns
        return ns

    def start(self, name: str, secret: MeshSecret = SECRET, *args: str) -> NsProcess:
        data = self.root / name
        save_mesh(data / "mesh.key", secret)  # same secret, no bootstrap address anywhere
        agent = self.lab.start_agent(self.hosts[name], data, "--name", name, *args)
        self.agents[name] = agent
        return agent


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lan]:
    require_netns()
    root = tmp_path_factory.mktemp("lan")
    lab = Lab(root)
    try:
        lan = Lan(lab, root)
        for i, name in enumerate(("a", "b", "c", "outsider")):
            lan.host(name, f"10.231.0.{11 + i}")
        yield lan
    finally:
        lab.close()


def test_three_agents_find_each_other_by_mdns_alone(lan: Lan):
    agents = [lan.start(name) for name in ("a", "b")]
    launched = datetime.now(UTC)  # the last agent's start (the logs share this clock)
    agents.append(lan.start("c"))
    ids = {lan.lab.status(a)["peer_id"] for a in agents}

    def everyone_sees_three():
        views = lan.lab.peers_of_all(agents)
        return all(_alive(v) == ids for v in views) and views

    views, _ = wait_until(everyone_sees_three, DISCOVERY_BOUND_S + 20, "3 peers everywhere")
    # Timed from the agents' own logs: from the last agent's start to the last membership
    # any agent learnt. Polling with the CLI would add its own start-up (seconds on a busy
    # machine) to what it measures.
    ids_of = [lan.lab.status(a)["peer_id"] for a in agents]
    joined = max(
        _logged_at(a, "gossip.peer_joined", ids_of[j])
        for i, a in enumerate(agents)
        for j in range(len(agents))
        if i != j
    )
    took = (joined - launched).total_seconds()
    print(f"\nall 3 agents know each other {took:.1f} s after the last one started")
    assert took <= DISCOVERY_BOUND_S
    for v in views:
        assert len(v["peers"]) == 3
        others = [p for p in v["peers"] if not p["self"]]
        assert {p["path"] for p in others} == {"direct"}
        assert all(p["address"].startswith("10.231.0.") for p in others)
        assert all(p["compute_speed"] and p["mem_weights_bytes"] for p in v["peers"])
    for a in agents:  # found by mDNS, not by any configured address
        assert '"mdns.found"' in a.log_text()
        assert '"agent.bootstrapped"' not in a.log_text()


def test_an_agent_of_another_mesh_is_seen_on_mdns_but_never_a_peer(lan: Lan):
    members = [lan.agents[n] for n in ("a", "b", "c")]
    outsider = lan.start("outsider", MeshSecret(os.urandom(32)), "--peer", "10.231.0.11:9338")
    out_id = lan.lab.status(outsider)["peer_id"]

    def seen_everywhere():
        return all(
            any(s["peer_id"] == out_id and not s["same_mesh"] for s in st["mdns"]["seen"])
            for st in (lan.lab.status(a) for a in members)
        )

    wait_until(seen_everywhere, 20, "outsider visible on mDNS")
    for a in members:
        assert '"mdns.refused"' in a.log_text() and out_id in a.log_text()
    # Its direct dial to a is refused by the handshake, and logged on both sides.
    wait_until(lambda: '"handshake.refused"' in members[0].log_text(), 20, "a logs the refusal")
    wait_until(lambda: '"dial.refused"' in outsider.log_text(), 20, "outsider told why")
    time.sleep(3)  # a few gossip rounds: it must not leak in through anyone
    for view in lan.lab.peers_of_all([*members, outsider]):
        assert out_id not in {p["peer_id"] for p in view["peers"]} or view["self"] == out_id
    assert len(lan.lab.peers(outsider)["peers"]) == 1  # only itself


def test_kill_9_is_detected_and_a_restart_rejoins(lan: Lan):
    a, b, c = (lan.agents[n] for n in ("a", "b", "c"))
    ids = {n: lan.lab.status(lan.agents[n])["peer_id"] for n in ("a", "b", "c")}
    wait_until(
        lambda: all(_alive(v) == set(ids.values()) for v in lan.lab.peers_of_all([a, b, c])),
        30,
        "3 alive before the kill",
    )
    dead_after = lan.lab.status(a)["gossip"]["dead_after_s"]
    assert dead_after <= 10
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait()
    killed = time.monotonic()
    killed_at = datetime.now(UTC)

    def c_dead_everywhere():
        views = lan.lab.peers_of_all([a, b])
        states = [{p["peer_id"]: p["state"] for p in v["peers"]}.get(ids["c"]) for v in views]
        return all(s == "dead" for s in states)

    wait_until(c_dead_everywhere, dead_after + 15, "c marked dead by a and b", interval=0.1)
    seen = time.monotonic() - killed
    # When each agent declared it (its own log), independent of how fast we can poll: at
    # most dead_after plus the age of c's last heartbeat plus one gossip tick.
    declared = [_dead_at(x, ids["c"]) - killed_at for x in (a, b)]
    took = max(d.total_seconds() for d in declared)
    print(f"\nkill -9: c declared dead by a and b after {took:.1f} s (dead_after {dead_after} s)")
    print(f"`meshagent peers` showed it dead on both after {seen:.1f} s")
    assert took <= dead_after + 2
    # Gossip converged: both hold the same view, and c is not routed to.
    views = lan.lab.peers_of_all([a, b])
    assert [_alive(v) for v in views] == [{ids["a"], ids["b"]}] * 2

    restarted = lan.start("c")  # same data dir: same identity
    assert lan.lab.status(restarted)["peer_id"] == ids["c"]
    _, took = wait_until(
        lambda: all(
            _alive(v) == set(ids.values()) for v in lan.lab.peers_of_all([a, b, restarted])
        ),
        30,
        "c back everywhere",
    )
    print(f"restarted c rejoined in {took:.1f} s")
