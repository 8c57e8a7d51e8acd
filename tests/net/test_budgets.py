"""Budgets per peer and in total (docs/protocol.md, section 5.1): authenticated connections a
member may open under one identity or many, the streams it may hold open on one connection,
and its streams per service. Past a budget the new connection or stream is refused with a
logged reason; the agent, and everyone else's streams, go on. Over TCP and the simulated
network."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
from structlog.testing import capture_logs

from meshagent.net.budgets import StreamBudgets
from meshagent.net.errors import StreamResetError
from meshagent.net.stream import MeshStream
from meshagent.wire.errors import ErrorCode
from meshagent.wire.frames import OpenFrame, encode_frame
from tests.net.support import (
    hash_exchange,
    hash_reply,
    honest_handshake,
    local_peer,
    node,
    quick,
)


@asynccontextmanager
async def _served_and_member(env, route):
    """Node "a", serving its streams by `route`, and member "m" connected to it."""
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_stream=route) as (a, addr),
        node(env, "m", nursery, listen=False) as (m, _),
    ):
        await m.dial(addr, peer_id=a.peer_id)
        yield a, m
        nursery.cancel_scope.cancel()


async def held_or_hashed(stream: MeshStream) -> None:
    """`hold` streams stay open until the peer resets them; others get a hash reply."""
    if stream.label == "hold":
        await trio.sleep_forever()
    await hash_reply(stream)


async def wait_for(predicate, *, period: float = 0.005) -> None:
    while not predicate():
        await trio.sleep(period)


async def test_inbound_connections_past_the_total_are_refused_with_a_reason(env, clock):
    config = quick(max_inbound_connections=2)
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, config=config) as (a, addr),
        node(env, "b", nursery, listen=False) as (b, _),
        node(env, "c", nursery, listen=False) as (c, _),
        node(env, "d", nursery, listen=False) as (d, _),
    ):
        with capture_logs() as logs, trio.fail_after(30):
            await b.dial(addr, peer_id=a.peer_id)
            await c.dial(addr, peer_id=a.peer_id)
            refused = await d.dial(addr, peer_id=a.peer_id)  # a fresh identity: a third peer
            await refused.wait_closed()
            assert refused.close_code is ErrorCode.REFUSED
            assert "connection refused" in refused.close_reason
            assert "2 inbound connections are open" in refused.close_reason
            said = [e for e in logs if e["event"] == "peer.connection_refused"]
            assert [e["peer"] for e in said] == [d.peer_id] and said[0]["reason"]
            # The peers within the budget are served as before.
            await hash_exchange(await b.open_stream(a.peer_id), [b"b" * 70_000])
            await hash_exchange(await c.open_stream(a.peer_id), [b"c" * 70_000])
            assert {x.peer_id for x in a.connections()} == {b.peer_id, c.peer_id}
            # Once one leaves, there is room again.
            await b.aclose(grace=0)
            await wait_for(lambda: len(a.connections()) == 1)
            await d.dial(addr, peer_id=a.peer_id)
            await hash_exchange(await d.open_stream(a.peer_id), [b"d"])
        nursery.cancel_scope.cancel()


async def test_one_identity_holds_an_active_connection_and_one_being_replaced(env, clock):
    """A peer id may hold one active connection and one draining; a third is refused."""
    mallory = local_peer()
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_stream=held_or_hashed) as (a, addr),
        node(env, "m1", nursery, listen=False, local=mallory) as (m1, _),
        node(env, "m2", nursery, listen=False, local=mallory) as (m2, _),
        node(env, "m3", nursery, listen=False, local=mallory) as (m3, _),
        node(env, "bob", nursery, listen=False) as (bob, _),
    ):
        with capture_logs() as logs, trio.fail_after(30):
            first = await m1.dial(addr, peer_id=a.peer_id)
            await first.open_stream("hold")  # keeps the first draining once replaced
            await wait_for(lambda: len(a.connections()) == 1)
            await m2.dial(addr, peer_id=a.peer_id)
            await wait_for(lambda: len(a.connections()) == 2)
            assert sum(x.draining for x in a.connections()) == 1
            third = await m3.dial(addr, peer_id=a.peer_id)
            await third.wait_closed()
            assert third.close_code is ErrorCode.REFUSED
            assert "2 connections open to us already" in third.close_reason
            [said] = [e for e in logs if e["event"] == "peer.connection_refused"]
            assert said["peer"] == mallory.peer_id
            # Another member connects and is served all along.
            await bob.dial(addr, peer_id=a.peer_id)
            await hash_exchange(await bob.open_stream(a.peer_id), [b"bob" * 1000])
        nursery.cancel_scope.cancel()


async def test_a_peer_that_opens_more_streams_than_allowed_is_refused_with_a_logged_reason(
    env, clock
):
    """The multiplexer's own bound: streams a peer holds open on one connection."""
    local = local_peer(max_streams=2)
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, local=local, on_stream=held_or_hashed) as (a, addr),
    ):
        with capture_logs() as logs, trio.fail_after(30):
            stream, _, sealer = await honest_handshake(env, "mallory", addr, local_peer())
            for sid in (1, 3, 5):  # a peer that ignores the announced limit
                await stream.send_all(sealer.seal(encode_frame(OpenFrame(sid, 1000, 10, "hold"))))
            await wait_for(lambda: any(e["event"] == "stream.refused" for e in logs))
        [said] = [e for e in logs if e["event"] == "stream.refused"]
        assert said["stream"] == 5 and "too many open streams" in said["reason"]
        [conn] = a.connections()
        assert conn.mux.open_streams == 2 and not conn.is_closed
        await trio.aclose_forcefully(stream)
        nursery.cancel_scope.cancel()


async def test_streams_past_a_services_budget_are_refused_per_peer(env, clock):
    budgets = StreamBudgets({"slow/1": 2})
    served = trio.Event()

    async def slow(stream: MeshStream) -> None:  # replies once the asker half-closes
        await hash_reply(stream)
        served.set()

    def route(stream: MeshStream):
        return budgets.admit(stream, stream.label.split(":", 1)[0], slow)

    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_stream=route) as (a, addr),
        node(env, "m", nursery, listen=False) as (m, _),
        node(env, "bob", nursery, listen=False) as (bob, _),
    ):
        with capture_logs() as logs, trio.fail_after(30):
            await m.dial(addr, peer_id=a.peer_id)
            await bob.dial(addr, peer_id=a.peer_id)
            held = [await m.open_stream(a.peer_id, "slow/1") for _ in range(2)]
            await wait_for(lambda: budgets.open_streams(m.peer_id, "slow/1") == 2)
            over = await m.open_stream(a.peer_id, "slow/1:suffix")
            with pytest.raises(StreamResetError) as refused:
                await over.receive_some()
            assert refused.value.code is ErrorCode.REFUSED_STREAM and refused.value.by_peer
            assert "over budget" in refused.value.reason
            [said] = [e for e in logs if e["event"] == "stream.refused"]
            assert said["peer"] == m.peer_id and said["label"] == "slow/1:suffix"
            assert budgets.refused["slow/1"] == 1
            # Another peer has a budget of its own; unbudgeted labels pass; the held
            # streams are served; once one ends there is room again.
            await hash_exchange(await bob.open_stream(a.peer_id, "slow/1"), [b"bob"])
            await hash_exchange(await m.open_stream(a.peer_id, "other/1"), [b"free"])
            await hash_exchange(held[0], [])
            await wait_for(lambda: budgets.open_streams(m.peer_id, "slow/1") == 1)
            await hash_exchange(await m.open_stream(a.peer_id, "slow/1"), [b"again"])
            await hash_exchange(held[1], [])
        assert served.is_set()
        nursery.cancel_scope.cancel()


async def test_of_streams_that_arrive_together_the_first_ones_are_served(env, clock):
    """The budget is judged as each stream arrives, not when its task first runs (tasks
    started together run in no set order): streams opened back to back, without waiting,
    are served or refused by their order."""
    budgets = StreamBudgets({"slow/1": 2})

    def route(stream: MeshStream):
        return budgets.admit(stream, "slow/1", hash_reply)

    async with _served_and_member(env, route) as (a, m):
        with trio.fail_after(30):
            for _ in range(12):  # arrival order kept every time, not by luck
                streams = [await m.open_stream(a.peer_id, "slow/1") for _ in range(4)]
                for over in streams[2:]:
                    with pytest.raises(StreamResetError) as refused:
                        await over.receive_some()
                    assert refused.value.code is ErrorCode.REFUSED_STREAM
                for held in streams[:2]:
                    await hash_exchange(held, [b"first"])
                await wait_for(lambda: budgets.open_streams(m.peer_id, "slow/1") == 0)


async def test_a_stream_the_peer_has_seen_end_no_longer_counts(env, clock):
    """The budget frees a stream as it ends both ways here, before the peer can see it end,
    not when its handler returns: a peer that opens the next stream straight after reading
    the last one's EOF is within budget, even while the handler still lingers."""
    budgets = StreamBudgets({"slow/1": 1})
    lingering = 0

    async def reply_then_linger(stream: MeshStream) -> None:
        nonlocal lingering
        await hash_reply(stream)
        lingering += 1
        await trio.sleep(60)

    def route(stream: MeshStream):
        return budgets.admit(stream, "slow/1", reply_then_linger)

    async with _served_and_member(env, route) as (a, m):
        with trio.fail_after(30):
            for _ in range(3):
                await hash_exchange(await m.open_stream(a.peer_id, "slow/1"), [b"next"])
            assert budgets.refused["slow/1"] == 0
            await wait_for(lambda: lingering == 3)
            assert budgets.open_streams(m.peer_id, "slow/1") == 0


def test_a_budget_is_at_least_one_stream():
    with pytest.raises(ValueError):
        StreamBudgets({"x/1": 0})
