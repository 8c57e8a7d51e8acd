"""GossipService over the simulated overlay: publishing, change notifications, RTTs, rate
limits, leaving."""

from __future__ import annotations

from dataclasses import replace

import trio

from meshagent.discovery.dialer import DialerConfig
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.failure import PeerState
from meshagent.identity.keys import NodeIdentity
from meshagent.testing.sim_agents import start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork

CFG = GossipConfig(rtt_refresh=2.0)


async def _three(nursery, config=CFG):
    return (await _three_on(nursery, config))[1]


async def _three_on(nursery, config=CFG):
    net = SimNetwork(default=LinkSpec(latency=0.025), seed=1)
    agents = [
        await start_sim_agent(nursery, net, f"h{i}", seed=i, gossip_config=config) for i in range(3)
    ]
    for x in agents[1:]:
        await x.overlay.dial(agents[0].overlay.listen_addresses[0])
    everyone = {a.peer_id for a in agents}
    with trio.fail_after(10):
        while not all(a.alive_view() == everyone for a in agents):
            await trio.sleep(0.1)
    return net, agents


async def _full_mesh(agents):
    """Wait until every agent has a connection to every other (the dialer makes them)."""
    with trio.fail_after(10):
        pairs = [(a, b) for a in agents for b in agents if a is not b]
        while not all(a.overlay.connection(b.peer_id) is not None for a, b in pairs):
            await trio.sleep(0.1)


async def test_update_local_reaches_everyone_and_wakes_waiters(autojump_clock):
    async with trio.open_nursery() as nursery:
        a, _b, c = await _three(nursery)
        gen = c.gossip.generation
        a.gossip.update_local(mem_kv_bytes=12345, extras={"claims": [1, 2]})
        with trio.fail_after(5):
            gen = await c.gossip.wait_changed(gen)
            while c.gossip.snapshot()[a.peer_id].record.mem_kv_bytes != 12345:
                gen = await c.gossip.wait_changed(gen)
        assert c.gossip.snapshot()[a.peer_id].record.extras == {"claims": [1, 2]}
        nursery.cancel_scope.cancel()


async def test_spread_now_sends_a_change_at_once_where_rounds_would_wait(autojump_clock):
    async with trio.open_nursery() as nursery:
        agents = await _three(nursery)
        a, _b, c = agents
        for x in agents:  # no more rounds from here (the ones under way still run)
            x.gossip.config = replace(
                x.gossip.config, interval=600, suspect_after=900, dead_after=1200
            )
        await trio.sleep(2)

        async def seen(kv: int, within: float) -> bool:
            with trio.move_on_after(within):
                while c.gossip.snapshot()[a.peer_id].record.mem_kv_bytes != kv:
                    await c.gossip.wait_changed(c.gossip.generation)
                return True
            return False

        a.gossip.update_local(mem_kv_bytes=111)
        assert not await seen(111, 5.0)  # published, but no round carries it
        a.gossip.update_local(mem_kv_bytes=222)
        a.gossip.spread_now()
        await trio.sleep(0.06)  # that exchange is under way (25 ms links), past its delta
        a.gossip.update_local(mem_kv_bytes=333)
        a.gossip.spread_now()
        assert await seen(333, 0.5)  # a few round trips of 50 ms
        nursery.cancel_scope.cancel()


async def test_records_carry_measured_rtts(autojump_clock):
    async with trio.open_nursery() as nursery:
        a, b, c = await _three(nursery)
        await trio.sleep(12)  # overlay pings every 5 s; records refresh every 2 s
        rec = b.gossip.snapshot()[a.peer_id].record
        rtts = dict(rec.rtts_ms)
        assert set(rtts) == {b.peer_id, c.peer_id}
        assert all(45 <= ms <= 60 for ms in rtts.values()), rtts  # 2 x 25 ms
        assert rec.addresses == (str(a.overlay.listen_addresses[0]),)
        nursery.cancel_scope.cancel()


async def test_inbound_exchanges_are_rate_limited(autojump_clock):
    config = GossipConfig(inbound_burst=2, inbound_rate=0.5)
    async with trio.open_nursery() as nursery:
        a, b, _ = await _three(nursery, config)
        before = a.gossip.refused_exchanges
        for _ in range(5):
            await b.gossip._exchange_with(a.peer_id)
        assert a.gossip.refused_exchanges - before >= 3
        nursery.cancel_scope.cancel()


async def test_a_crashed_agent_is_dead_everywhere_within_seconds(autojump_clock):
    # Its connections end without BYE and nothing listens where it did: the peers that were
    # connected to it declare it dead at once instead of waiting out dead_after.
    async with trio.open_nursery() as nursery:
        a, b, c = await _three(nursery)
        c.scope.cancel()  # no leave(): a crash
        crashed = trio.current_time()
        with trio.fail_after(CFG.dead_after):
            while any(c.peer_id in x.alive_view() for x in (a, b)):
                await trio.sleep(0.05)
        assert trio.current_time() - crashed < 2.5 < CFG.dead_after
        nursery.cancel_scope.cancel()


async def test_a_crashed_agent_restarted_where_it_was_is_found_again(autojump_clock):
    # The agent everyone joined through crashes and comes back at its address, knowing no
    # one (its only bootstrap address is its own): the others, having declared it dead, look
    # at its address now and then, find it listening and dial it.
    async with trio.open_nursery() as nursery:
        net = SimNetwork(default=LinkSpec(latency=0.025), seed=1)
        identity = NodeIdentity.generate()
        a = await start_sim_agent(nursery, net, "h0", seed=0, identity=identity, port=7000)
        b, c = [await start_sim_agent(nursery, net, f"h{i}", seed=i) for i in (1, 2)]
        for x in (b, c):
            await x.overlay.dial(a.overlay.listen_addresses[0])
        await _full_mesh((a, b, c))
        a.scope.cancel()
        with trio.fail_after(5):
            while a.peer_id in b.alive_view() or a.peer_id in c.alive_view():
                await trio.sleep(0.05)
        await trio.sleep(30)  # dead for a while: the looks are some seconds apart by now
        a = await start_sim_agent(nursery, net, "h0", seed=3, identity=identity, port=7000)
        back = trio.current_time()
        with trio.fail_after(15):
            while {b.peer_id, c.peer_id} - a.alive_view() or any(
                a.peer_id not in x.alive_view() for x in (b, c)
            ):
                await trio.sleep(0.1)
        assert trio.current_time() - back <= DialerConfig().dead_probe_max + 2
        nursery.cancel_scope.cancel()


async def test_a_dead_agent_is_not_dialled_while_nothing_listens_at_its_address(autojump_clock):
    async with trio.open_nursery() as nursery:
        a, _b, c = await _three(nursery)
        dials = []
        real_dial = a.overlay.dial

        async def counting_dial(*args, **kwargs):
            dials.append(kwargs.get("peer_id"))
            return await real_dial(*args, **kwargs)

        a.overlay.dial = counting_dial
        c.scope.cancel()
        await trio.sleep(120)
        assert c.peer_id not in dials  # looked at (a bare connect), never dialled
        assert c.peer_id not in a.alive_view()
        nursery.cancel_scope.cancel()


async def test_a_broken_connection_to_a_live_agent_is_no_death(autojump_clock):
    # The transport drops a connection but the agent still listens: it is dialled again,
    # and nobody declares it dead.
    async with trio.open_nursery() as nursery:
        a, b, c = await _three(nursery)
        for x in (a, b):
            conn = x.overlay.connection(c.peer_id)
            if conn is not None:
                await trio.aclose_forcefully(conn._transport)
        await trio.sleep(2 * CFG.dead_after)
        for x in (a, b):
            assert c.peer_id in x.alive_view()
            assert x.overlay.connection(c.peer_id) is not None
        dead = [x.gossip.snapshot(include_dead=True)[c.peer_id].state for x in (a, b)]
        assert dead == [PeerState.ALIVE, PeerState.ALIVE]
        nursery.cancel_scope.cancel()


async def test_a_leaving_agent_is_dead_everywhere_at_once(autojump_clock):
    async with trio.open_nursery() as nursery:
        a, b, c = await _three(nursery)
        await c.gossip.leave()
        c.scope.cancel()
        left = trio.current_time()
        with trio.fail_after(3):
            while any(c.peer_id in x.alive_view() for x in (a, b)):
                await trio.sleep(0.05)
        assert trio.current_time() - left < 2.5 < CFG.dead_after
        assert a.gossip.snapshot(include_dead=True)[c.peer_id].state is PeerState.DEAD
        nursery.cancel_scope.cancel()


async def test_a_silent_agent_is_dead_everywhere_within_three_seconds(autojump_clock):
    # A power cut: every link of c goes quiet, then its processes die. No reset reaches
    # anyone; the peers see PINGs go unanswered, ask each other, and nobody heard from c.
    async with trio.open_nursery() as nursery:
        net, (a, b, c) = await _three_on(nursery)
        await _full_mesh((a, b, c))
        net.isolate("h2")
        c.scope.cancel()
        cut = trio.current_time()
        with trio.fail_after(CFG.dead_after):
            while any(c.peer_id in x.alive_view() for x in (a, b)):
                await trio.sleep(0.05)
        assert trio.current_time() - cut <= 3.0 < CFG.dead_after
        reason = a.gossip.snapshot(include_dead=True)[c.peer_id]
        assert reason.state is PeerState.DEAD
        assert a.overlay.connection(c.peer_id) is None  # the silent connection is dropped
        nursery.cancel_scope.cancel()


async def test_a_partition_between_two_agents_is_no_death(autojump_clock):
    # a and c cannot reach each other for 10 s, but b hears both: c's heartbeats reach a
    # through b, so nobody declares c (or a) dead. a drops the silent connection, and once
    # the link heals it is connected to c again.
    async with trio.open_nursery() as nursery:
        net, (a, b, c) = await _three_on(nursery)
        await _full_mesh((a, b, c))
        net.cut("h0", "h2")
        for _ in range(20):
            await trio.sleep(0.5)
            for x in (a, b, c):
                assert {a.peer_id, b.peer_id, c.peer_id} <= x.alive_view() | {x.peer_id}
        assert a.overlay.connection(c.peer_id) is None  # the silent path was dropped
        net.heal("h0", "h2")
        with trio.fail_after(10):
            while a.overlay.connection(c.peer_id) is None:
                await trio.sleep(0.1)
        states = [x.gossip.snapshot(include_dead=True)[c.peer_id].state for x in (a, b)]
        assert states == [PeerState.ALIVE, PeerState.ALIVE]
        nursery.cancel_scope.cancel()
