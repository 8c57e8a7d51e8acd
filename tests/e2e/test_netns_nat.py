"""Across NATs, over real sockets: two agents, each behind a NAT router namespace (nftables,
`meshagent/testing/nat_rules.py`), meet through a relay on the "internet" side. The relay
tells each its public address and whether its NAT maps by destination; behind cone NATs the
lower peer id punches a hole through both and the pair moves to a direct connection; behind
two symmetric NATs they stay relayed, and `meshagent peers` says why."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from meshagent.identity.mesh import MeshSecret
from meshagent.identity.mesh_file import save_mesh
from meshagent.testing.nat_rules import ruleset
from tests.e2e.netns import Lab, require_netns, wait_until

pytestmark = pytest.mark.slow


def _require_nft() -> None:
    if shutil.which("nft") is None:
        pytest.skip("the NAT tests need nftables (`nft`; .ci/run installs it as root)")


def _link_to(body: dict, peer: str) -> dict | None:
    return next((p for p in body["peers"] if p["peer_id"] == peer), None)


def _behind_nats(lab: Lab, tmp_path: Path, kinds: tuple[str, str]) -> tuple[list, list[str]]:
    """The relay's namespace routes between two NAT routers (10.240.N.0/24 outside); behind
    router N, host N at 192.168.N.2. Returns the two agents (started) and their peer ids."""
    r = lab.ns("r")
    lab.sysctl(r, "net.ipv4.ip_forward", "1")
    relay = lab.spawn(
        r, "relay", sys.executable, "-m", "meshagent", "relay",
        "--listen", "0.0.0.0:9339", "--log-format", "json",
    )  # fmt: skip
    wait_until(lambda: '"relay.started"' in relay.log_text(), 30, "relay started")
    secret = MeshSecret(os.urandom(32))
    agents = []
    for n, kind in enumerate(kinds, start=1):
        nat, host = lab.ns(f"n{n}"), lab.ns(f"h{n}")
        lab.link(nat, "wan", f"10.240.{n}.2/24", r, f"r{n}", f"10.240.{n}.1/24")
        lab.link(host, "eth0", f"192.168.{n}.2/24", nat, "lan", f"192.168.{n}.1/24")
        lab.sysctl(nat, "net.ipv4.ip_forward", "1")
        lab.run(nat, "ip", "route", "add", "default", "via", f"10.240.{n}.1")
        lab.run(host, "ip", "route", "add", "default", "via", f"192.168.{n}.1")
        rules = tmp_path / f"nat{n}.nft"
        rules.write_text(ruleset(kind, outside="wan", inside="lan", host=f"192.168.{n}.2"))
        lab.run(nat, "nft", "-f", str(rules))
        data = tmp_path / f"agent{n}"
        save_mesh(data / "mesh.key", secret)
        agents.append(
            lab.start_agent(
                host, data, "--name", f"agent{n}", "--relay", f"10.240.{n}.1:9339", "--no-mdns"
            )
        )
    ids = [lab.status(a)["peer_id"] for a in agents]
    return agents, ids


def test_two_agents_behind_cone_nats_punch_through_to_direct(tmp_path: Path):
    require_netns()
    _require_nft()
    lab = Lab(tmp_path)
    try:
        (a, b), (ida, idb) = _behind_nats(lab, tmp_path, ("port-restricted", "port-restricted"))
        began = time.monotonic()

        def reach_known():
            st = lab.status(a)
            return st["reachability"]["nat"] == "independent" and st

        st, _ = wait_until(reach_known, 30, "the relay tells agent1 its NAT")
        assert st["reachability"]["public"] == ["10.240.1.2:9338"]
        assert "10.240.1.2:9338" in st["advertised"]

        def direct_both_ways():
            pa, pb = lab.peers_of_all([a, b])
            la, lb = _link_to(pa, idb), _link_to(pb, ida)
            return la and lb and la["path"] == lb["path"] == "direct" and (la, lb)

        (la, lb), _ = wait_until(direct_both_ways, 40, "a direct connection")
        print(f"\ndirect {time.monotonic() - began:.1f} s after both agents were ready")
        puncher = a if ida < idb else b
        assert '"dialer.punched"' in puncher.log_text()
        # Each reaches the other at its NAT's public address, not the private one.
        assert {la["address"], lb["address"]} <= {"10.240.1.2:9338", "10.240.2.2:9338"}
    finally:
        lab.close()


def test_two_agents_behind_symmetric_nats_stay_relayed_and_say_why(tmp_path: Path):
    require_netns()
    _require_nft()
    lab = Lab(tmp_path)
    try:
        (a, b), (ida, idb) = _behind_nats(lab, tmp_path, ("symmetric", "symmetric"))

        def relayed_and_said():
            pa, pb = lab.peers_of_all([a, b])
            la, lb = _link_to(pa, idb), _link_to(pb, ida)
            ok = la and lb and la["path"] == lb["path"] == "relayed"
            return ok and la.get("nat") == "dependent" and la["why_relayed"] and la

        la, _ = wait_until(relayed_and_said, 40, "relayed, with the reason")
        assert "symmetric" in la["why_relayed"]
        assert lab.status(a)["reachability"]["nat"] == "dependent"
    finally:
        lab.close()


def test_a_punched_path_that_dies_falls_back_to_the_relay_and_comes_back(tmp_path: Path):
    # Two agents alone: the only other member that could say the peer is alive is the relay.
    require_netns()
    _require_nft()
    lab = Lab(tmp_path)
    try:
        (a, b), (ida, idb) = _behind_nats(lab, tmp_path, ("port-restricted", "port-restricted"))

        def paths(want: str):
            pa, pb = lab.peers_of_all([a, b])
            la, lb = _link_to(pa, idb), _link_to(pb, ida)
            return la and lb and la["path"] == lb["path"] == want and la["state"] == "alive"

        wait_until(lambda: paths("direct"), 40, "a direct connection")
        # The first NAT drops everything between it and the other NAT from now on, as a
        # router that forgot its mappings and lets nothing unsolicited in would.
        nat1 = next(ns for ns in lab.namespaces if ns.endswith("n1"))
        for rule in ("ip daddr 10.240.2.2 drop", "ip saddr 10.240.2.2 drop"):
            lab.run(nat1, "nft", "insert", "rule", "ip", "meshnat", "forward", *rule.split())
        _, took = wait_until(lambda: paths("relayed"), 40, "back on the relay")
        print(f"\nrelayed again {took:.1f} s after the direct path died")
        lab.run(nat1, "nft", "flush", "chain", "ip", "meshnat", "forward")
        rules = (tmp_path / "nat1.nft").read_text()
        lab.run(nat1, "nft", "delete", "table", "ip", "meshnat")
        lab.run(nat1, "nft", "-f", str(tmp_path / "nat1.nft"))
        assert rules
        _, took = wait_until(lambda: paths("direct"), 90, "direct again")
        print(f"direct again {took:.1f} s after the path came back")
    finally:
        lab.close()
