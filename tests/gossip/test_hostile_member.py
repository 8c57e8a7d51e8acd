"""A member that answers every gossip exchange with forged obituaries, on the simulated mesh:
the agents it lies to go on, and the peer it lies about stays alive everywhere."""

from __future__ import annotations

import trio

from meshagent.gossip.failure import PeerState
from meshagent.gossip.messages import Delta, Items, decode, encode, framing
from meshagent.gossip.signed import Obituary
from meshagent.identity.keys import NodeIdentity
from meshagent.testing.sim_network import LinkSpec, SimNetwork
from meshagent.wire.framing import LengthPrefixDecoder
from tests.gossip.sim_mesh import SECRET, SimAgent, start_sim_agent

MINUTE_MS = 60_000


def forging(obituaries):
    """A `gossip/1` responder that answers every digest with `obituaries()` (fresh each
    time) and honours nothing else of the protocol."""

    async def serve(stream) -> None:
        frames = LengthPrefixDecoder(framing(2 << 20))

        async def next_message() -> object | None:
            while (frame := frames.next_frame()) is None:
                data = await stream.receive_some()
                if not data:
                    return None
                frames.feed(data)
            return decode(frame)

        try:
            await next_message()  # the initiator's digest
            await stream.send_all(encode(Delta(Items(obituaries=tuple(obituaries())))))
            await next_message()  # its final delta
            await stream.send_eof()
        except trio.BrokenResourceError:
            pass

    return serve


async def _mesh_with_liar(nursery, obituaries_of) -> tuple[list[SimAgent], SimAgent]:
    """Three honest agents and a fourth whose gossip answers carry `obituaries_of(victim)`;
    returns (honest agents, the victim among them is the second)."""
    net = SimNetwork(default=LinkSpec(latency=0.01), seed=3)
    honest = [await start_sim_agent(nursery, net, f"h{i}", seed=i) for i in range(3)]
    victim = honest[1]
    liar = await start_sim_agent(
        nursery, net, "liar", seed=9, serve_gossip=forging(lambda: obituaries_of(victim))
    )
    for x in [*honest[1:], liar]:
        await x.overlay.dial(honest[0].overlay.listen_addresses[0])
    return honest, victim


def _obituary(victim: SimAgent, beat: int) -> bytes:
    return Obituary.sign(
        NodeIdentity.generate(), victim.peer_id, beat, SECRET.fingerprint
    ).to_cbor()


def _alive_everywhere(honest: list[SimAgent], victim: SimAgent) -> bool:
    return all(
        a.gossip.snapshot().get(victim.peer_id) is not None
        and a.gossip.snapshot()[victim.peer_id].state is PeerState.ALIVE
        for a in honest
    )


async def test_obituaries_near_2_64_neither_stop_their_subject_nor_keep_it_dead(autojump_clock):
    async with trio.open_nursery() as nursery:
        honest, victim = await _mesh_with_liar(nursery, lambda v: [_obituary(v, 2**64 - 1)])
        await trio.sleep(3)  # every agent has exchanged with the liar by now, many times
        beats = [honest[0].gossip.beat_of(victim.peer_id)]
        for _ in range(20):
            await trio.sleep(1)
            assert _alive_everywhere(honest, victim)
            beats.append(honest[0].gossip.beat_of(victim.peer_id))
        assert beats[-1] > beats[0]  # the victim's gossip goes on beating
        for a in honest:
            assert a.gossip.state.stats.rejected["obituary"] > 0
        nursery.cancel_scope.cancel()


async def test_an_obituary_within_the_lead_is_refuted_at_once(autojump_clock):
    # Dated nearly as far ahead as others take: the victim is dead only until its refutation
    # spreads, and the same obituary told again is stale.
    sent: list[int] = []

    def same(v: SimAgent) -> list[bytes]:
        if not sent:
            sent.append(v.gossip.state.me.beat + 9 * MINUTE_MS)
        return [_obituary(v, sent[0])]

    async with trio.open_nursery() as nursery:
        honest, victim = await _mesh_with_liar(nursery, same)
        with trio.fail_after(10):
            while not sent:
                await trio.sleep(0.1)
        await trio.sleep(5)
        assert _alive_everywhere(honest, victim)
        assert victim.gossip.state.me.beat > sent[0]
        nursery.cancel_scope.cancel()


async def test_an_error_inside_one_exchange_ends_that_exchange_only(autojump_clock):
    async with trio.open_nursery() as nursery:
        honest, victim = await _mesh_with_liar(nursery, lambda v: [])
        await trio.sleep(2)
        apply = victim.gossip.state.apply

        def broken(*args, **kwargs):
            raise RuntimeError("a bug met by one exchange")

        victim.gossip.state.apply = broken
        victim.gossip.exchange_with_all()  # as initiator: these fail in its own service
        await trio.sleep(0.5)
        victim.gossip.state.apply = apply
        assert victim.gossip.failed_exchanges >= 1
        await trio.sleep(5)
        assert _alive_everywhere(honest, victim)
        nursery.cancel_scope.cancel()
