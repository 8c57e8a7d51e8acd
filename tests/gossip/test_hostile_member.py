"""A member that answers every gossip exchange with forged items, on the simulated mesh: the
agents it lies to go on, the peer it lies about stays alive everywhere, and the members it
makes up leave room for real ones."""

from __future__ import annotations

import trio

from meshagent.gossip.config import GossipConfig
from meshagent.gossip.failure import PeerState
from meshagent.gossip.messages import Delta, Items, decode, encode, framing
from meshagent.gossip.peer_record import PeerRecord
from meshagent.gossip.signed import Heartbeat, Obituary, SignedRecord
from meshagent.identity.keys import NodeIdentity
from meshagent.testing.sim_agents import SECRET, SimAgent, start_sim_agent
from meshagent.testing.sim_network import LinkSpec, SimNetwork
from meshagent.wire.framing import LengthPrefixDecoder

MINUTE_MS = 60_000


def forging(obituaries):
    """A `gossip/1` responder that answers every digest with `obituaries()` (fresh each
    time) and honours nothing else of the protocol."""
    return answering(lambda: Items(obituaries=tuple(obituaries())))


def answering(items):
    """A `gossip/1` responder that answers every digest with `items()` (fresh each time)
    and honours nothing else of the protocol."""

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
            await stream.send_all(encode(Delta(items())))
            await next_message()  # its final delta
            await stream.send_eof()
        except trio.BrokenResourceError:
            pass

    return serve


async def _mesh_with_liar(
    nursery, obituaries_of, net: SimNetwork | None = None
) -> tuple[list[SimAgent], SimAgent]:
    """Three honest agents and a fourth whose gossip answers carry `obituaries_of(victim)`;
    returns (honest agents, the victim among them is the second)."""
    net = net or SimNetwork(default=LinkSpec(latency=0.01), seed=3)
    honest = await _mesh(nursery, net, lambda agents: forging(lambda: obituaries_of(agents[1])))
    return honest, honest[1]


async def _mesh(
    nursery, net: SimNetwork, liar_answers, config: GossipConfig | None = None
) -> list[SimAgent]:
    """Three honest agents and a fourth whose gossip answers are `liar_answers(honest)`, all
    dialled to the first; returns the honest ones."""
    honest = [
        await start_sim_agent(nursery, net, f"h{i}", seed=i, gossip_config=config) for i in range(3)
    ]
    liar = await start_sim_agent(nursery, net, "liar", seed=9, serve_gossip=liar_answers(honest))
    for x in [*honest[1:], liar]:
        await x.overlay.dial(honest[0].overlay.listen_addresses[0])
    return honest


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


async def test_a_plausible_obituary_about_a_peer_everyone_hears_changes_nobody_s_view(
    autojump_clock,
):
    # Signed by the member itself, dated one beat after the victim's latest: what a peer that
    # lost the victim would say. Every honest agent has a connection to the victim that
    # answers its PINGs, so none takes it.
    liar_identity = NodeIdentity.generate()

    def plausible(v: SimAgent) -> list[bytes]:
        beat = v.gossip.state.me.beat + 1
        return [Obituary.sign(liar_identity, v.peer_id, beat, SECRET.fingerprint).to_cbor()]

    async with trio.open_nursery() as nursery:
        honest, victim = await _mesh_with_liar(nursery, plausible)
        with trio.fail_after(5):
            while not _alive_everywhere(honest, victim):
                await trio.sleep(0.1)
        for _ in range(200):  # 10 s, looked at every 50 ms
            await trio.sleep(0.05)
            for a in honest:
                if a is not victim:
                    view = a.gossip.snapshot().get(victim.peer_id)
                    assert view is not None and view.state is PeerState.ALIVE
                    assert not any(d.dead for d in a.gossip.state.digest())
        for a in honest:
            if a is not victim:
                assert a.gossip.state.stats.disputed > 0
        nursery.cancel_scope.cancel()


async def test_once_the_victim_is_gone_the_obituary_is_taken(autojump_clock):
    # The same obituary about a peer that has stopped: the link goes silent, and a copy
    # pushed again is believed (well before the silence alone would say so).
    liar_identity = NodeIdentity.generate()
    beats: list[int] = []

    def plausible(v: SimAgent) -> list[bytes]:
        beats.append(v.gossip.state.me.beat + 1)
        return [Obituary.sign(liar_identity, v.peer_id, beats[-1], SECRET.fingerprint).to_cbor()]

    net = SimNetwork(default=LinkSpec(latency=0.01), seed=3)
    async with trio.open_nursery() as nursery:
        honest, victim = await _mesh_with_liar(nursery, plausible, net)
        await trio.sleep(3)
        net.isolate(victim.name)  # no BYE, no reset: a power cut
        victim.scope.cancel()
        stopped = trio.current_time()
        rest = [a for a in honest if a is not victim]
        with trio.fail_after(3):  # gossip's own dead_after is 8 s
            while not all(victim.peer_id not in a.alive_view() for a in rest):
                await trio.sleep(0.1)
        print(f"dead everywhere {trio.current_time() - stopped:.1f} s after it stopped")
        nursery.cancel_scope.cancel()


async def test_a_flood_of_made_up_members_leaves_room_for_an_agent_that_joins(autojump_clock):
    config = GossipConfig(max_members=48)
    fakes = [NodeIdentity.generate() for _ in range(config.max_members)]  # a delta holds no more
    mesh = SECRET.fingerprint
    records = tuple(
        SignedRecord.sign(PeerRecord(f.peer_id, f.public_key, seq=1, name="nobody"), f, mesh).raw
        for f in fakes
    )

    def flood() -> Items:  # kept beating, so that none of them looks dead
        beat = 2_000_000_000_000 + int(trio.current_time() * 1000)
        return Items(records, tuple(Heartbeat.sign(f, beat, mesh).to_cbor() for f in fakes))

    net = SimNetwork(default=LinkSpec(latency=0.01), seed=3)
    async with trio.open_nursery() as nursery:
        honest = await _mesh(nursery, net, lambda _: answering(flood), config)
        with trio.fail_after(10):
            while not all(len(a.gossip.state.entries) == config.max_members for a in honest):
                await trio.sleep(0.1)
        # Every table is full of made-up members: a real agent joins by its invite, h0.
        newcomer = await start_sim_agent(nursery, net, "new", seed=7, gossip_config=config)
        dialled = trio.current_time()
        await newcomer.overlay.dial(honest[0].overlay.listen_addresses[0])
        everyone = {a.peer_id for a in [*honest, newcomer]}

        def known(a: SimAgent) -> set[str]:  # with a record to dial, alive
            return {p for p, v in a.gossip.snapshot().items() if v.record.addresses} & everyone

        with trio.fail_after(10):
            while not all(known(a) == everyone for a in [*honest, newcomer]):
                await trio.sleep(0.1)
        joined = trio.current_time()
        await trio.sleep(10)  # and it stays, while the flood goes on
        for a in [*honest, newcomer]:
            assert known(a) == everyone
            assert len(a.gossip.state.entries) <= config.max_members
            assert a.gossip.snapshot()[newcomer.peer_id].state is PeerState.ALIVE
        print(f"in every table {joined - dialled:.1f} s after it dialled")
        nursery.cancel_scope.cancel()
