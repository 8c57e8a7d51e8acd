"""A relay serving several meshes at once: each mesh's circuits and bytes are reported apart,
and the per-mesh caps (circuits, bandwidth of all its circuits together) hold for each."""

from __future__ import annotations

import pytest
import trio

from meshagent.identity.mesh import MeshSecret
from meshagent.relay import protocol as p
from meshagent.relay.errors import Refusal, RelayRefused
from meshagent.relay.limits import RelayLimits
from tests.relay.support import mesh_pairs, push_through, start_agent, start_relay

MESHES = [MeshSecret(bytes([0x60 + i]) * 32) for i in range(8)]
MIB = 1 << 20


async def test_eight_meshes_each_held_to_its_caps_and_reported_apart(sim_env, autojump_clock):
    limits = RelayLimits(
        rate_bytes_per_s=4 * MIB, mesh_rate_bytes_per_s=MIB, circuits_per_mesh=2, idle_timeout=60
    )
    async with trio.open_nursery() as nursery:
        server, address, _ = await start_relay(sim_env, nursery, limits)
        pairs = await mesh_pairs(sim_env, nursery, address, MESHES)
        # 4 MiB through each mesh's circuit: its own 4 MiB/s, the mesh's 1 MiB/s.
        took = await push_through(pairs, 4)
        # Each mesh got its own megabyte a second, not a share of one.
        assert all(3.0 <= t <= 6.0 for t in took.values()), took
        stats = server.stats()
        per_mesh = stats["per_mesh"]
        assert len(per_mesh) == 8
        for use in per_mesh.values():
            assert use["circuits_total"] == 1 and use["agents"] == 2
            assert use["circuits_open"] == 1 and use["bytes_relayed"] >= 4 * MIB
        assert sum(u["bytes_relayed"] for u in per_mesh.values()) == stats["bytes_relayed"]
        # Mesh 0 has one circuit open; a second is in its cap, a third is not; another mesh
        # is untouched by it.
        a = pairs[0][0]
        c = await start_agent(sim_env, nursery, "c0", address, mesh=MESHES[0])
        d = await start_agent(sim_env, nursery, "d0", address, mesh=MESHES[0])
        await a.client.dial(c.peer_id)
        with pytest.raises(RelayRefused, match="per-mesh limit") as info:
            await a.client.dial(d.peer_id)
        assert info.value.code is Refusal.CIRCUIT_LIMIT
        e = await start_agent(sim_env, nursery, "e1", address, mesh=MESHES[1])
        await pairs[1][0].client.dial(e.peer_id)
        name = p.rendezvous_tag(MESHES[0]).hex()[:12]
        assert server.stats()["per_mesh"][name]["refusals"] == {"circuit_limit": 1}
        nursery.cancel_scope.cancel()
