"""SwimService over the simulated overlay (Noise, streams, the dialer): members find each
other's records, a change reaches everyone, a crashed member is declared dead everywhere, one
that leaves is dead at once, and a member's bad message ends its stream only."""

from __future__ import annotations

import trio

from meshagent.gossip.failure import PeerState
from meshagent.gossip.swim_service import LABEL
from meshagent.testing.sim_agents import crash_until_dead_everywhere, start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork


async def _mesh(nursery, n: int = 4):
    net = SimNetwork(default=LinkSpec(latency=0.025), seed=1)
    agents = [
        await start_sim_agent(nursery, net, f"h{i}", seed=i, membership="swim") for i in range(n)
    ]
    for x in agents[1:]:
        await x.overlay.dial(agents[0].overlay.listen_addresses[0])
    everyone = {a.peer_id for a in agents}
    with trio.fail_after(10):
        while not all(a.alive_view() == everyone for a in agents):
            await trio.sleep(0.1)
    return net, agents


async def test_members_learn_every_record_and_a_change_reaches_everyone(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, agents = await _mesh(nursery)
        a, c = agents[0], agents[-1]
        for x in agents:  # every record, with its addresses (the dialer's input)
            for y in agents:
                assert x.gossip.snapshot()[y.peer_id].record.addresses
        gen = c.gossip.generation
        a.gossip.update_local(mem_kv_bytes=12345, extras={"claims": [1, 2]})
        with trio.fail_after(3):
            while c.gossip.snapshot()[a.peer_id].record.mem_kv_bytes != 12345:
                gen = await c.gossip.wait_changed(gen)
        assert c.gossip.snapshot()[a.peer_id].record.extras == {"claims": [1, 2]}
        assert all(x.gossip.stats()["rejected"] == 0 for x in agents)
        nursery.cancel_scope.cancel()


async def test_a_crashed_member_is_dead_everywhere_within_seconds(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, agents = await _mesh(nursery)
        victim, rest = agents[1], [x for x in agents if x is not agents[1]]
        await trio.sleep(5)
        # Probes find it (or the dialer, when its connections break): well within 5 s here.
        assert await crash_until_dead_everywhere(victim, rest) < 5
        await trio.sleep(10)  # and nobody else is suspected meanwhile
        for x in rest:
            assert x.alive_view() == {y.peer_id for y in rest}
        nursery.cancel_scope.cancel()


async def test_a_member_that_leaves_is_dead_at_once(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, agents = await _mesh(nursery)
        leaver = agents[2]
        await leaver.gossip.leave(peers=3)
        with trio.fail_after(1):
            while any(
                x.gossip.snapshot(include_dead=True)[leaver.peer_id].state is not PeerState.DEAD
                for x in agents
                if x is not leaver
            ):
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()


async def test_a_bad_message_ends_its_stream_only(autojump_clock):
    async with trio.open_nursery() as nursery:
        _, agents = await _mesh(nursery, 3)
        a, b = agents[0], agents[1]
        failed = b.gossip.stats()["failed"]
        for junk in (b"\xff\xfe", b"\x86" + b"\x00" * 5, bytes(5 << 20)):
            stream = await a.overlay.open_stream(b.peer_id, LABEL)
            try:
                await stream.send_all(junk)
                await stream.send_eof()
                while await stream.receive_some():
                    pass
            except Exception:
                pass
            await stream.aclose()
        await trio.sleep(1)
        assert b.gossip.stats()["failed"] >= failed + 3
        # b is unharmed: it still hears a's changes.
        a.gossip.update_local(mem_kv_bytes=777)
        with trio.fail_after(3):
            while b.gossip.snapshot()[a.peer_id].record.mem_kv_bytes != 777:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def test_a_join_lost_in_flight_is_sent_again_until_the_peer_is_a_member(autojump_clock):
    """A join can die with a connection that closes under it (one replaced by a better
    one, say). The joiner asks again while the peer stays out of its view: otherwise a
    member that knew it before, and so sends no join of its own, stays unknown to it."""
    async with trio.open_nursery() as nursery:
        net = SimNetwork(default=LinkSpec(latency=0.025), seed=1)
        a = await start_sim_agent(nursery, net, "a", seed=1, membership="swim")
        b = await start_sim_agent(nursery, net, "b", seed=2, membership="swim")
        lost = []
        post_a, post_b = a.gossip._post, b.gossip._post

        def a_posts(dest, frame):  # a's messages to b go nowhere for the first second
            if trio.current_time() < 1.0:
                lost.append(dest)
                return
            post_a(dest, frame)

        def b_posts(dest, frame):  # b's first message to a (its join) is lost
            if not lost or "b" not in lost:
                lost.append("b")
                return
            post_b(dest, frame)

        a.gossip._post, b.gossip._post = a_posts, b_posts
        await b.overlay.dial(a.overlay.listen_addresses[0])
        await trio.sleep(1.5)
        assert lost  # the test lost what it meant to
        with trio.fail_after(10):
            while a.peer_id not in b.alive_view() or b.peer_id not in a.alive_view():
                await trio.sleep(0.1)
        assert b.gossip.snapshot()[a.peer_id].record.addresses
        nursery.cancel_scope.cancel()


async def test_two_members_that_buried_each_other_while_still_connected_come_back(autojump_clock):
    """Two agents alone, whose direct path died while each probed the other, declare each
    other dead; they meet again over another path (a relay). Neither sends gossip to a member
    it holds dead, so neither would hear the other's refutation: a connected member held dead
    is asked for its digest, learns of its death, refutes it, and both are alive again."""
    async with trio.open_nursery() as nursery:
        _, (a, b) = await _mesh(nursery, 2)
        a.gossip.declare_dead(b.peer_id, "the test says so")
        b.gossip.declare_dead(a.peer_id, "the test says so")
        assert a.alive_view() == {a.peer_id} and b.alive_view() == {b.peer_id}
        assert a.overlay.connection(b.peer_id) is not None  # still connected
        with trio.fail_after(10):
            while a.alive_view() != b.alive_view() or len(a.alive_view()) != 2:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def test_a_member_that_left_stays_dead_while_its_connections_drain(autojump_clock):
    """A member that leaves stays connected while its connections drain; the others, which
    now hold it dead, may still speak to it then. It refutes no death of its own: it left."""
    async with trio.open_nursery() as nursery:
        _, agents = await _mesh(nursery, 3)
        leaver, rest = agents[2], agents[:2]
        await leaver.gossip.leave(peers=2)
        await trio.sleep(8)  # the others sync with it, and gossip, all the while
        assert all(x.overlay.connection(leaver.peer_id) is not None for x in rest)
        for x in rest:
            assert x.alive_view() == {y.peer_id for y in rest}
        nursery.cancel_scope.cancel()
