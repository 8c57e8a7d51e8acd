"""Acceptance 2: two agents with no route between them connect through a relay in a third
namespace, which carries only ciphertext (checked on a packet capture taken in the relay's
namespace); when a route appears they move to a direct connection by drain-and-close while
a stream is mid-transfer, and no byte is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshagent.discovery.probe import PAYLOAD
from meshagent.identity.mesh import MeshSecret
from meshagent.identity.mesh_file import save_mesh
from tests.e2e.netns import Lab, require_netns, wait_until

pytestmark = pytest.mark.slow

PROBE_BYTES = 4 << 20
PROBE_SECONDS = 4.0


def _link_to(body: dict, peer: str) -> dict | None:
    return next((p for p in body["peers"] if p["peer_id"] == peer), None)


def test_relay_then_direct_without_plaintext_or_loss(tmp_path: Path):
    require_netns()
    lab = Lab(tmp_path)
    try:
        r, a, b = lab.ns("r"), lab.ns("a"), lab.ns("b")
        lab.link(a, "eth0", "10.232.1.2/24", r, "ra", "10.232.1.1/24")
        lab.link(b, "eth0", "10.232.2.2/24", r, "rb", "10.232.2.1/24")
        lab.sysctl(r, "net.ipv4.ip_forward", "0")  # the relay's host routes nothing
        assert lab.run(a, "ping", "-c1", "-W1", "10.232.2.2", check=False).returncode != 0

        capture = tmp_path / "relay.pcap"
        sniffer = lab.spawn(
            r, "sniffer", sys.executable, str(Path(__file__).parent / "sniff.py"), str(capture)
        )
        wait_until(lambda: "ready" in sniffer.log_text(), 10, "sniffer ready")
        relay = lab.spawn(
            r,
            "relay",
            sys.executable,
            "-m",
            "meshagent",
            "relay",
            "--listen",
            "0.0.0.0:9339",
            "--log-format",
            "json",
        )
        wait_until(lambda: '"relay.started"' in relay.log_text(), 30, "relay started")

        secret = MeshSecret(os.urandom(32))
        agents = {}
        for name, ns, relay_ip in (("a", a, "10.232.1.1"), ("b", b, "10.232.2.1")):
            data = tmp_path / name
            save_mesh(data / "mesh.key", secret)
            (data / "config.toml").write_text("upgrade_interval = 1.0\n")
            agents[name] = lab.start_agent(
                ns, data, "--name", name, "--relay", f"{relay_ip}:9339", "--no-mdns"
            )
        ida = lab.status(agents["a"])["peer_id"]
        idb = lab.status(agents["b"])["peer_id"]

        def relayed_both_ways():
            pa, pb = lab.peers_of_all([agents["a"], agents["b"]])
            la, lb = _link_to(pa, idb), _link_to(pb, ida)
            return (
                la
                and lb
                and la["path"] == lb["path"] == "relayed"
                and la["state"] == "alive"
                and (pa, pb)
            )

        (before_a, _), took = wait_until(relayed_both_ways, 40, "relayed connection")
        print(f"\nrelayed connection up {took:.1f} s after both agents started")
        assert _link_to(before_a, idb)["address"] == "relay 10.232.1.1:9339"

        # A probe of known plaintext, paced so that it is mid-transfer when the route appears.
        probe = subprocess.Popen(
            ["ip", "netns", "exec", a, sys.executable, "-m", "meshagent", "peers", "--probe", idb,
             "--probe-bytes", str(PROBE_BYTES), "--probe-seconds", str(PROBE_SECONDS),
             "--json", "--data-dir", str(agents["a"].data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # The route appears once the stream is under way (the CLI may take seconds to start).
        wait_until(lambda: '"probe.started"' in agents["a"].log_text(), 30, "probe started")
        time.sleep(0.5)
        lab.sysctl(r, "net.ipv4.ip_forward", "1")
        lab.run(a, "ip", "route", "add", "10.232.2.0/24", "via", "10.232.1.1")
        lab.run(b, "ip", "route", "add", "10.232.1.0/24", "via", "10.232.2.1")
        route_added = time.monotonic()
        out, err = probe.communicate(timeout=60)
        assert probe.returncode == 0, err
        result = json.loads(out)
        print(f"probe: {result}")
        assert result["ok"] and result["bytes_received_by_peer"] == PROBE_BYTES  # no byte lost
        assert result["path"] == "relayed"  # the stream began on the relayed connection...
        assert result["path_after"] == "direct"  # ...which was replaced while it ran

        def direct_both_ways():
            pa, pb = lab.peers_of_all([agents["a"], agents["b"]])
            return _link_to(pa, idb)["path"] == _link_to(pb, ida)["path"] == "direct" and pa

        after_a, _ = wait_until(direct_both_ways, 20, "direct connection")
        print(f"direct within {time.monotonic() - route_added:.1f} s of the route appearing")
        assert _link_to(after_a, idb)["address"] == "10.232.2.2:9338"
        wait_until(lambda: '"relay.circuit_closed"' in relay.log_text(), 20, "circuit closed")
        assert (
            '"conn.draining"' in agents["a"].log_text()
            or '"conn.draining"' in agents["b"].log_text()
        )
    finally:
        lab.close()

    frames = capture.read_bytes()
    assert len(frames) > 2 * PROBE_BYTES, "the probe's bytes crossed the relay's namespace"
    # The capture works: the relay protocol's own cleartext (peer ids in MEMBERS) is in it.
    assert idb.encode() in frames and ida.encode() in frames
    # ...but not one copy of the probe's plaintext, nor of the mesh secret.
    assert PAYLOAD[:24] not in frames
    assert secret.value not in frames
