"""PeerDialer on the simulated network: direct first, relay as fallback, upgrade to direct,
backoff for the unreachable, no redialing of the dead."""

from __future__ import annotations

import itertools

import trio

from meshagent.discovery.dialer import DialerConfig, PeerDialer
from meshagent.net.connection import DIRECT, RELAYED
from meshagent.relay.limits import RelayLimits
from tests.relay.support import start_agent, start_relay

QUICK = DialerConfig(upgrade_interval=2.0, retry_initial=1.0, connect_timeout=2.0)


async def _pair(env, nursery):
    _, relay, _ = await start_relay(env, nursery, RelayLimits())
    a = await start_agent(env, nursery, "a", relay)
    b = await start_agent(env, nursery, "b", relay)
    dialer = PeerDialer(
        a.overlay,
        relay_dial=lambda r, p: a.client.dial(p),
        local_relays=lambda: (a.client.name,),
        config=QUICK,
    )
    await nursery.start(dialer.run)
    return a, b, dialer


async def _direct_then_cut(env, nursery):
    """a and b connected directly (both also reach the relay), then the path between them
    cut for 2 s: its PINGs go unanswered."""
    a, b, dialer = await _pair(env, nursery)
    address = str(b.overlay.listen_addresses[0])
    dialer.offer(b.peer_id, addresses=(address,), relays=(a.client.name,), source="test")
    with trio.fail_after(10):
        direct = await a.overlay.wait_connected(b.peer_id)
    assert direct.path == DIRECT
    env.sim.cut("a", "b")
    await trio.sleep(2)
    return a, b, dialer, direct


async def test_direct_when_reachable(sim_env, autojump_clock):
    async with trio.open_nursery() as nursery:
        a, b, dialer = await _pair(sim_env, nursery)
        dialer.offer(b.peer_id, addresses=(str(b.overlay.listen_addresses[0]),), source="test")
        with trio.fail_after(10):
            conn = await a.overlay.wait_connected(b.peer_id)
        assert conn.path == DIRECT
        nursery.cancel_scope.cancel()


async def test_relay_when_blocked_then_upgrade_when_the_route_appears(sim_env, autojump_clock):
    async with trio.open_nursery() as nursery:
        a, b, dialer = await _pair(sim_env, nursery)
        a.transport.blocked.add("b")
        dialer.offer(
            b.peer_id,
            addresses=(str(b.overlay.listen_addresses[0]),),
            relays=(a.client.name,),
            source="test",
        )
        with trio.fail_after(20):
            relayed = await a.overlay.wait_connected(b.peer_id)
        assert relayed.path == RELAYED
        await trio.sleep(10)
        assert a.overlay.connection(b.peer_id) is relayed  # still blocked: still relayed
        a.transport.blocked.clear()
        with trio.fail_after(QUICK.upgrade_interval + 10):
            while a.overlay.connection(b.peer_id).path != DIRECT:
                await trio.sleep(0.1)
        await relayed.wait_closed()
        assert relayed.close_reason == "replaced"
        nursery.cancel_scope.cancel()


async def test_unreachable_peer_is_retried_with_backoff(sim_env, autojump_clock):
    async with trio.open_nursery() as nursery:
        a, _b, dialer = await _pair(sim_env, nursery)
        attempts = []
        real_dial = a.overlay.dial

        async def counting_dial(*args, **kwargs):
            attempts.append(trio.current_time())
            return await real_dial(*args, **kwargs)

        a.overlay.dial = counting_dial
        dialer.offer("nosuchpeer" + "x" * 16, addresses=("nowhere:1",), source="test")
        await trio.sleep(60)
        gaps = [y - x for x, y in itertools.pairwise(attempts)]
        assert 3 <= len(attempts) <= 10, attempts
        assert max(gaps) >= 8  # backing off, not hammering
        nursery.cancel_scope.cancel()


async def test_a_silent_direct_path_is_replaced_through_the_relay_at_once(sim_env, autojump_clock):
    # The direct path between a and b goes quiet (a partition between them; both still reach
    # the relay). Judged a bad path, the connection is dropped and the next one goes through
    # the relay straight away, without first waiting out a direct connect to the cut path;
    # once the path is back, the connection is upgraded to direct again.
    async with trio.open_nursery() as nursery:
        a, b, dialer, direct = await _direct_then_cut(sim_env, nursery)
        judged = trio.current_time()
        dialer.silent(direct)
        with trio.fail_after(20):
            while (c := a.overlay.connection(b.peer_id)) is None or c.path != RELAYED:
                await trio.sleep(0.05)
        took = trio.current_time() - judged
        assert took < QUICK.silence_confirm + QUICK.connect_timeout  # no direct try first
        sim_env.sim.heal("a", "b")
        with trio.fail_after(QUICK.upgrade_interval + 15):
            while (c := a.overlay.connection(b.peer_id)) is None or c.path != DIRECT:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()


async def test_a_path_that_answers_while_the_others_are_asked_is_kept(sim_env, autojump_clock):
    # A direct path goes quiet for a moment (a busy host) and answers again while the dialer
    # asks the other peers whether they hear the peer: the connection stays, where it was
    # once dropped as "no answer for 0.0 s on this path", breaking a split's streams.
    async with trio.open_nursery() as nursery:
        a, b, dialer, direct = await _direct_then_cut(sim_env, nursery)
        asked = dialer._ask_all

        async def slow_answers(others, about):
            sim_env.sim.heal("a", "b")
            await trio.sleep(2)  # the peer's PONGs come back meanwhile
            return await asked(others, about)

        dialer._ask_all = slow_answers
        dialer.silent(direct)
        await trio.sleep(QUICK.silence_confirm + 10)
        assert not direct.is_closed and a.overlay.connection(b.peer_id) is direct
        nursery.cancel_scope.cancel()
