"""Acceptance 5: gossip over the simulated network, under a virtual clock."""

from __future__ import annotations

import trio

from meshagent.gossip.failure import PeerState
from meshagent.testing.sim_agents import start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork

N = 30
CONVERGE_BOUND_S = 5.0  # virtual seconds from the dials to a full view everywhere (measured: 2.0)


async def test_30_agents_converge_then_detect_a_death(autojump_clock):
    net = SimNetwork(default=LinkSpec(latency=0.010), seed=3)
    async with trio.open_nursery() as nursery:
        agents = [await start_sim_agent(nursery, net, f"h{i}", seed=i) for i in range(N)]
        seed_addr = agents[0].overlay.listen_addresses[0]
        for a in agents[1:]:
            nursery.start_soon(a.overlay.dial, seed_addr)
        started = trio.current_time()
        everyone = {a.peer_id for a in agents}
        with trio.fail_after(CONVERGE_BOUND_S):
            while not all(a.alive_view() == everyone for a in agents):
                await trio.sleep(0.1)
        converged = trio.current_time() - started
        print(f"\nfull membership at all {N} agents after {converged:.1f} virtual s")

        # Steady state: bytes per agent per second, and no false suspicion.
        before = [a.gossip.bytes_sent for a in agents]
        window = 30.0
        suspects = 0
        t_end = trio.current_time() + window
        while trio.current_time() < t_end:
            await trio.sleep(0.5)
            for a in agents:
                suspects += sum(
                    v.state is not PeerState.ALIVE for v in a.gossip.snapshot().values()
                )
        sent = [a.gossip.bytes_sent - b for a, b in zip(agents, before, strict=True)]
        per_agent = sum(sent) / N / window
        print(f"gossip payload sent per agent: {per_agent:.0f} B/s (max {max(sent) / window:.0f})")
        assert suspects == 0, "no peer should look suspect while every agent is healthy"
        assert all(len(a.overlay.links()) == N - 1 for a in agents), "full mesh of connections"

        # Kill one: every other agent marks it dead within dead_after + 2 intervals.
        victim = agents[7]
        victim.scope.cancel()
        killed = trio.current_time()
        cfg = agents[0].gossip.config
        rest = [a for a in agents if a is not victim]
        with trio.fail_after(cfg.dead_after + 2 * cfg.interval):
            while not all(victim.peer_id not in a.alive_view() for a in rest):
                await trio.sleep(0.1)
        print(f"victim dead everywhere after {trio.current_time() - killed:.1f} virtual s")
        nursery.cancel_scope.cancel()
