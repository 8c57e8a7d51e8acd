"""Across NATs, over real sockets: two agents, each behind a NAT router namespace (nftables,
`meshagent/testing/nat_rules.py`), meet through a relay on the "internet" side. The relay
tells each its public address and whether its NAT maps by destination; behind cone NATs the
one of them punches a hole through both and the pair moves to a direct connection; behind
two symmetric NATs they stay relayed, and `meshagent peers` says why. A punched path that
dies falls back to the relay, a split stream on it completes with the same text, and the
pair punches through again once the path is back."""

from __future__ import annotations

import json
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


def _both(lab: Lab, agents: list, ids: list[str], want: str) -> bool:
    """Whether each of the two agents sees the other alive on a `want` path."""
    (a, b), (ida, idb) = agents, ids
    pa, pb = lab.peers_of_all([a, b])
    la, lb = _link_to(pa, idb), _link_to(pb, ida)
    return bool(la and lb and la["path"] == lb["path"] == want and la["state"] == "alive")


def _split_routable(lab: Lab, agent) -> bool:
    st = lab.status(agent)["placement"].get(MODEL) or {}
    return bool(st.get("routable") and len(st.get("stages", [])) == 2)


def _behind_nats(
    lab: Lab, tmp_path: Path, kinds: tuple[str, str], *flags: str
) -> tuple[list, list[str]]:
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
        # Relayed peers try direct every second (not 5): punches retry 1, 2, 4 s... apart.
        (data / "config.toml").write_text("upgrade_interval = 1.0\n")
        agents.append(
            lab.start_agent(
                host,
                data,
                "--name",
                f"agent{n}",
                "--relay",
                f"10.240.{n}.1:9339",
                "--no-mdns",
                *flags,
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
        agents, ids = _behind_nats(lab, tmp_path, ("port-restricted", "port-restricted"))

        def paths(want: str) -> bool:
            return _both(lab, agents, ids, want)

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


MODEL = "SmolLM2-135M-Instruct.Q4_1"
# One streamed greedy chat request from inside a namespace: each chunk's text as a JSON line
# to the file named, then {"done": true} once [DONE] arrives.
CLIENT = """
import json, sys, httpx
url, out = sys.argv[1], open(sys.argv[2], "w", buffering=1)
body = {"model": sys.argv[3], "max_tokens": int(sys.argv[4]), "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": "Tell me about the rivers of Europe."}]}
with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
    for line in r.iter_lines():
        if line == "data: [DONE]":
            out.write(json.dumps({"done": True}) + "\\n")
        elif line.startswith("data: "):
            d = json.loads(line[6:])
            if "error" in d:
                out.write(json.dumps({"error": d["error"]}) + "\\n")
            for c in d.get("choices", []):
                out.write(json.dumps({"text": c["delta"].get("content") or ""}) + "\\n")
"""


def _stream(lab: Lab, agent, out: Path, tokens: int = 160):
    url = json.loads((agent.data_dir / "agent.json").read_text())["api"]
    return lab.spawn(
        agent.ns, out.stem, sys.executable, "-c", CLIENT, url, str(out), MODEL, str(tokens)
    )


def _block(lab: Lab, nat: str) -> None:
    """Everything between the first NAT and the second's public address dropped there."""
    for rule in ("ip daddr 10.240.2.2 drop", "ip saddr 10.240.2.2 drop"):
        lab.run(nat, "nft", "insert", "rule", "ip", "meshnat", "forward", *rule.split())


def _unblock(lab: Lab, nat: str, rules: Path) -> None:
    lab.run(nat, "nft", "delete", "table", "ip", "meshnat")
    lab.run(nat, "nft", "-f", str(rules))


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def test_a_split_stream_survives_its_punched_path_dying(tmp_path: Path):
    # 75 MB each: neither agent holds the model whole, the two hold it split.
    require_netns()
    _require_nft()
    lab = Lab(tmp_path)
    try:
        agents, ids = _behind_nats(
            lab, tmp_path, ("port-restricted", "port-restricted"), "--max-memory", "75M"
        )
        a, idb = agents[0], ids[1]
        wait_until(lambda: _both(lab, agents, ids, "direct"), 40, "a direct connection")
        wait_until(lambda: _split_routable(lab, a), 120, "the split")
        calm = tmp_path / "calm.jsonl"
        _stream(lab, a, calm).proc.wait(timeout=300)
        said = _lines(calm)
        assert said[-1] == {"done": True}, said[-3:]
        expected = "".join(x.get("text", "") for x in said)
        cut = tmp_path / "cut.jsonl"
        client = _stream(lab, a, cut)
        wait_until(lambda: len(_lines(cut)) >= 20, 120, "the stream under way")
        _block(lab, next(ns for ns in lab.namespaces if ns.endswith("n1")))
        client.proc.wait(timeout=300)
        said = _lines(cut)
        assert said[-1] == {"done": True}, said[-3:]
        assert "".join(x.get("text", "") for x in said) == expected
        pa = lab.peers(a)
        assert _link_to(pa, idb)["path"] == "relayed"
    finally:
        lab.close()


def test_a_split_stream_over_the_relay_is_the_same_and_the_pair_punches_back(tmp_path: Path):
    # Not yet the stream moving mid-way: the punch comes back as the stream ends, and what is
    # open on the relayed connection finishes there (drain-and-close).
    require_netns()
    _require_nft()
    lab = Lab(tmp_path)
    try:
        agents, ids = _behind_nats(
            lab, tmp_path, ("port-restricted", "port-restricted"), "--max-memory", "90M",
            "--ctx-size", "1024",
        )  # fmt: skip
        a, b = agents

        def path(want: str) -> bool:
            return _both(lab, agents, ids, want)

        def routable() -> bool:
            return _split_routable(lab, a)

        wait_until(lambda: path("direct"), 40, "a direct connection")
        wait_until(routable, 120, "the split")
        calm = tmp_path / "calm.jsonl"
        _stream(lab, a, calm, 900).proc.wait(timeout=300)
        expected = "".join(x.get("text", "") for x in _lines(calm))
        assert _lines(calm)[-1] == {"done": True}
        # The direct path dies: back on the relay; a stream starts there, and the path comes
        # back while it runs: the stream's text is the same, and the pair goes direct again.
        nat1 = next(ns for ns in lab.namespaces if ns.endswith("n1"))
        _block(lab, nat1)
        wait_until(lambda: path("relayed"), 40, "back on the relay")
        wait_until(routable, 60, "the split over the relay")
        moved = tmp_path / "moved.jsonl"
        client = _stream(lab, a, moved, 900)
        wait_until(lambda: len(_lines(moved)) >= 10, 120, "the stream under way")
        _unblock(lab, nat1, tmp_path / "nat1.nft")
        began = time.monotonic()
        client.proc.wait(timeout=300)
        said = _lines(moved)
        assert said[-1] == {"done": True}, said[-3:]
        assert "".join(x.get("text", "") for x in said) == expected
        wait_until(lambda: path("direct"), 60, "direct again")
        print(f"\ndirect {time.monotonic() - began:.1f} s after the path came back")
        assert '"dialer.punched"' in (a.log_text() + b.log_text())
    finally:
        lab.close()
