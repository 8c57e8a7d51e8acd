"""`meshagent relay` as a process, under eight meshes at once over loopback TCP: each mesh is
held to its own caps (a mesh's circuits, the bandwidth of all its circuits together), and the
relay's report lists circuits and bytes per mesh."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from meshagent.identity.mesh import MeshSecret
from meshagent.net.address import Address
from meshagent.relay.errors import RelayRefused
from tests.net.support import NetEnv
from tests.relay.support import mesh_pairs, push_through, start_agent

pytestmark = pytest.mark.slow

MESHES = [MeshSecret(bytes([0x70 + i]) * 32) for i in range(8)]
MIB = 1 << 20


def _started(log: Path, proc: subprocess.Popen, timeout: float = 30.0) -> Address:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        for line in log.read_text().splitlines():
            if '"relay.started"' in line:
                return Address.parse(json.loads(line)["address"])
        time.sleep(0.1)
    raise AssertionError(f"the relay did not start: {log.read_text()}")


async def test_a_relay_process_holds_eight_meshes_to_their_caps_and_reports_each(tmp_path):
    log, report = tmp_path / "relay.log", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "meshagent", "relay", "--listen", "127.0.0.1:0"]
    cmd += ["--circuits-per-mesh", "2", "--mesh-rate", "1MiB", "--report-every", "0.5"]
    cmd += ["--report", str(report), "--log-format", "json"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        address = _started(log, proc)
        env = NetEnv("tcp")
        async with trio.open_nursery() as nursery:
            pairs = await mesh_pairs(env, nursery, address, MESHES)
            # 3 MiB through each mesh's one circuit, capped at 1 MiB/s for the mesh.
            took = await push_through(pairs, 3)
            print("\nseconds for 3 MiB, per mesh:", sorted(round(t, 2) for t in took.values()))
            assert min(took.values()) >= 1.5, took
            # Mesh 0 has one circuit open; a second fits its cap, a third does not.
            a = pairs[0][0]
            c = await start_agent(env, nursery, "c0", address, mesh=MESHES[0])
            d = await start_agent(env, nursery, "d0", address, mesh=MESHES[0])
            await a.client.dial(c.peer_id)
            with pytest.raises(RelayRefused, match="per-mesh limit"):
                await a.client.dial(d.peer_id)
            await trio.sleep(1.2)  # the next report
            stats = json.loads(report.read_text())
            nursery.cancel_scope.cancel()
        per_mesh = stats["per_mesh"]
        assert len(per_mesh) == 8
        for use in per_mesh.values():
            assert use["bytes_relayed"] >= 3 * MIB and use["circuits_total"] >= 1
        assert sum(u["bytes_relayed"] for u in per_mesh.values()) == stats["bytes_relayed"]
        assert sorted(u["circuits_total"] for u in per_mesh.values()) == [1] * 7 + [2]
        refused = [u["refusals"] for u in per_mesh.values() if u["refusals"]]
        assert len(refused) == 1 and sum(refused[0].values()) == 1, refused
    finally:
        proc.terminate()
        proc.wait(10)
