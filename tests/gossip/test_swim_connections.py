"""Membership by probes keeps connections to a bounded set of members (`discovery/keep.py`),
over the simulated overlay: every view is still full, a record change still reaches everyone
and a crash is still dead everywhere within seconds, while each agent holds far fewer
connections than there are members; a stream to a member it keeps no connection to dials it."""

from __future__ import annotations

import random

import trio

from meshagent.discovery import hearing
from meshagent.discovery.keep import IdleConnections, KeepConfig, KeepSet
from meshagent.testing.sim_agents import crash_until_dead_everywhere, start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork

N = 32
KEEP = KeepConfig(random=2, near=1, idle_close=1.0)


async def _mesh(nursery):
    net = SimNetwork(default=LinkSpec(latency=0.025), seed=2)
    agents = [
        await start_sim_agent(nursery, net, f"h{i}", seed=i, membership="swim", keep=KEEP)
        for i in range(N)
    ]
    for x in agents[1:]:
        x.dialer.offer(agents[0].peer_id, addresses=(str(agents[0].overlay.listen_addresses[0]),),
                       source="bootstrap")  # fmt: skip
    everyone = {a.peer_id for a in agents}
    with trio.fail_after(30):
        while not all(a.alive_view() == everyone for a in agents):
            await trio.sleep(0.1)
    return agents


def _opened(agent) -> int:
    return sum(1 for c in agent.overlay.connections() if c.initiator)


async def test_a_mesh_on_a_bounded_connection_set_keeps_its_views_and_finds_crashes(
    autojump_clock,
):
    async with trio.open_nursery() as nursery:
        agents = await _mesh(nursery)
        await trio.sleep(15)  # the joins' connections idle out
        # What each agent opened: its kept members (2 random, 1 near), and the few it
        # dialled for a message (a PING-REQ's target, a check) or kept before, not yet quiet
        # for their second.
        opened = [_opened(a) for a in agents]
        total = [len(a.overlay.connections()) for a in agents]
        assert max(opened) <= KEEP.random + KEEP.near + 5, opened
        assert sum(opened) / N <= KEEP.random + KEEP.near + 1, opened
        assert sum(total) / N < (N - 1) * 0.4, total
        # The agent everyone joined through keeps few of those joins.
        assert total[0] < (N - 1) / 2, total
        # A change still reaches everyone.
        a, c = agents[0], agents[-1]
        a.gossip.update_local(mem_kv_bytes=4242)
        with trio.fail_after(5):
            while any(x.gossip.snapshot()[a.peer_id].record.mem_kv_bytes != 4242 for x in agents):
                await trio.sleep(0.05)
        # A stream to a member without a connection dials it.
        far = next(x for x in agents[1:] if a.overlay.connection(x.peer_id) is None)
        heard = await hearing.ask(a.overlay, far.peer_id, about=a.peer_id, timeout=5.0)
        assert heard is not None and a.overlay.connection(far.peer_id) is not None
        # A crash is dead everywhere within seconds, and no one else is suspected.
        victim = agents[5]
        rest = [x for x in agents if x is not victim]
        assert await crash_until_dead_everywhere(victim, rest) < 5
        await trio.sleep(10)
        assert all(x.alive_view() == {y.peer_id for y in rest} for x in rest)
        assert c.gossip.stats()["rejected"] == 0
        nursery.cancel_scope.cancel()


def test_the_picks_stay_while_they_live_and_are_drawn_again_when_they_die():
    keep = KeepSet(KeepConfig(random=3, near=2), random.Random(1))
    members = [f"m{i}" for i in range(12)]
    rtt = {m: float(i) for i, m in enumerate(members)}
    first = keep.choose(members, rtt.get, pinned={"stage"})
    assert {"m0", "m1", "stage"} <= first and len(first) <= 6  # the 2 nearest, the pinned
    again = keep.choose(members, rtt.get)
    assert again == first - {"stage"}  # the same picks while they live
    gone = sorted(first - {"m0", "m1", "stage"})[0]
    members.remove(gone)
    after = keep.choose(members, rtt.get)
    assert gone not in after and len(after) == len(again)


def test_random_picks_are_uniform_over_the_mesh_not_stuck_on_the_first_members_seen():
    """An agent learns of its contact first and of the rest later: were its random picks
    kept from the first view, every agent would keep its contact, which would hold a
    connection from everyone."""
    members = [f"m{i:03d}" for i in range(200)]
    contact_kept = 0
    for seed in range(200):
        keep = KeepSet(KeepConfig(random=4, near=0), random.Random(seed))
        keep.choose(members[:1], lambda m: None)
        for n in (10, 50, 200):
            keep.choose(members[:n], lambda m: None)
        contact_kept += "m000" in keep.lasting()
    assert contact_kept < 200 * 4 / 200 * 4, contact_kept  # about 4 in 200 expected


def test_an_unkept_connection_closes_only_after_idling_its_time():
    idle = IdleConnections(3.0)
    assert idle.to_close(0.0, {"a", "b"}, kept={"a"}) == []
    assert idle.to_close(2.0, {"a", "b"}, kept={"a"}) == []
    assert idle.to_close(3.0, {"a", "b"}, kept={"a"}) == ["b"]
    # Busy again (not closable) or kept again: its idle time starts over.
    assert idle.to_close(4.0, {"a"}, kept=set()) == []
    assert idle.to_close(6.9, {"a", "b"}, kept=set()) == []
    assert idle.to_close(7.0, {"a", "b"}, kept=set()) == ["a"]


async def test_a_member_whose_connection_broke_is_probed_until_found_dead(autojump_clock):
    """The probes find a crash on their own: with a connection gone, a member is still
    probed by those that held one to it (here the dialer's own check cannot tell, as when
    the crashed machine's address gives no answer), so it is dead everywhere in seconds."""
    async with trio.open_nursery() as nursery:
        net = SimNetwork(default=LinkSpec(latency=0.005), seed=3)
        agents = [
            await start_sim_agent(nursery, net, f"h{i}", seed=i, membership="swim")
            for i in range(3)
        ]
        first = str(agents[0].overlay.listen_addresses[0])
        for x in agents[1:]:
            x.dialer.offer(agents[0].peer_id, addresses=(first,), source="bootstrap")
        everyone = {a.peer_id for a in agents}
        with trio.fail_after(30):
            while not all(a.alive_view() == everyone for a in agents):
                await trio.sleep(0.1)
        await trio.sleep(5)

        async def no_answer(address, *, timeout):
            return None

        for x in agents:
            x.overlay.listening_at = no_answer
        victim, rest = agents[2], agents[:2]
        assert await crash_until_dead_everywhere(victim, rest) < 5
        nursery.cancel_scope.cancel()
