"""The relay: rendezvous by mesh, circuits spliced end to end, limits and refusals."""

from __future__ import annotations

import hashlib

import pytest
import trio

from meshagent.net.connection import DIRECT, RELAYED
from meshagent.net.errors import ConnectionUnavailable
from meshagent.relay import protocol as p
from meshagent.relay.errors import Refusal, RelayRefused
from meshagent.relay.limits import RelayLimits
from tests.net.support import hash_exchange, read_all
from tests.relay.support import OTHER, start_agent, start_relay

CANARY = b"PLAINTEXT-CANARY-the quick brown fox jumps over the lazy relay "


async def test_members_find_each_other_and_splice_only_ciphertext(env, clock):
    async with trio.open_nursery() as nursery:
        server, address, captured = await start_relay(env, nursery)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        with trio.fail_after(30):
            while b.peer_id not in a.client.members or a.peer_id not in b.client.members:
                await trio.sleep(0.01)
            conn = await a.client.dial(b.peer_id)
            assert conn.path == RELAYED and conn.peer_id == b.peer_id
            assert (await b.overlay.wait_connected(a.peer_id)).path == RELAYED
            stream = await a.overlay.open_stream(b.peer_id, "canary")
            await hash_exchange(stream, [CANARY * 1000])
        assert server.stats()["circuits_open"] == 1
        relayed = captured.all_bytes
        assert len(relayed) > len(CANARY) * 1000  # the transfer did go through the relay
        assert b"PLAINTEXT-CANARY" not in relayed
        assert b"quick brown fox" not in relayed
        nursery.cancel_scope.cancel()


async def test_other_mesh_is_invisible_and_cannot_be_dialed(env, clock):
    async with trio.open_nursery() as nursery:
        server, address, _ = await start_relay(env, nursery)
        a = await start_agent(env, nursery, "a", address)
        outsider = await start_agent(env, nursery, "o", address, mesh=OTHER)
        await trio.sleep(1)
        assert a.client.members == set() and outsider.client.members == set()
        with pytest.raises(RelayRefused) as info:
            await outsider.client.dial(a.peer_id)
        assert info.value.code is Refusal.UNKNOWN_TARGET
        assert "not registered at this relay in your mesh" in str(info.value)
        assert server.stats()["refusals"] == {"unknown_target": 1}
        nursery.cancel_scope.cancel()


async def test_refusals_carry_reasons(env, clock):
    limits = RelayLimits(circuits_per_agent=1, accept_timeout=2.0)
    async with trio.open_nursery() as nursery:
        _server, address, _ = await start_relay(env, nursery, limits)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        c = await start_agent(env, nursery, "c", address)
        stranger = await start_agent(env, nursery, "s", address, register=False)
        with trio.fail_after(60):
            with pytest.raises(RelayRefused, match="must register") as info:
                await stranger.client.dial(a.peer_id)
            assert info.value.code is Refusal.NOT_REGISTERED
            with pytest.raises(RelayRefused, match="oneself"):
                await a.client.dial(a.peer_id)
            await a.client.dial(b.peer_id)
            with pytest.raises(RelayRefused, match="already has 1 circuits") as info:
                await c.client.dial(b.peer_id)
            assert info.value.code is Refusal.CIRCUIT_LIMIT
            # A forged request: signed by one key, claiming another's.
            stream, buf, nonce = await c.client._open()
            forged = p.connect(c.identity, nonce, a.peer_id)
            forged.fields[3] = bytes(64)
            await stream.send_all(forged.encode())
            reply = await read_reply(stream, buf)
            assert reply.type == p.REFUSED and reply.fields[2] == Refusal.BAD_SIGNATURE
        nursery.cancel_scope.cancel()


async def read_reply(stream, frames):
    while (body := frames.next_frame()) is None:
        frames.feed(await stream.receive_some(4096))
    return p.decode(body)


async def test_accept_timeout_when_the_target_never_accepts(env, clock):
    limits = RelayLimits(accept_timeout=2.0)
    async with trio.open_nursery() as nursery:
        _server, address, _ = await start_relay(env, nursery, limits)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)

        async def ignore(circuit, from_peer):  # b hears of the circuit but never takes it
            pass

        b.client._accept = ignore
        with trio.fail_after(30), pytest.raises(RelayRefused, match="did not accept") as info:
            await a.client.dial(b.peer_id)
        assert info.value.code is Refusal.ACCEPT_TIMEOUT
        nursery.cancel_scope.cancel()


async def test_bandwidth_limit(sim_env, autojump_clock):
    env = sim_env
    rate = 1 << 20
    limits = RelayLimits(rate_bytes_per_s=rate, idle_timeout=30.0)
    async with trio.open_nursery() as nursery:
        _server, address, _ = await start_relay(env, nursery, limits)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        conn = await a.client.dial(b.peer_id)
        stream = await a.overlay.open_stream(b.peer_id, "bulk")
        start = trio.current_time()
        await hash_exchange(stream, [bytes(1 << 20)] * 4)
        took = trio.current_time() - start
        assert 3.0 <= took <= 6.0, f"4 MiB at 1 MiB/s took {took:.2f} s"
        assert conn.path == RELAYED
        nursery.cancel_scope.cancel()


async def test_idle_circuit_is_closed(sim_env, autojump_clock):
    env = sim_env
    limits = RelayLimits(idle_timeout=30.0)
    async with trio.open_nursery() as nursery:
        server, address, _ = await start_relay(env, nursery, limits)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        accepted = trio.Event()
        raw_b: list = []

        async def raw_accept(circuit, from_peer):  # b takes the circuit but runs no overlay
            stream, buf, nonce = await b.client._open()
            await stream.send_all(p.accept(b.identity, nonce, circuit).encode())
            assert (await read_reply(stream, buf)).type == p.SPLICED
            raw_b.append(stream)
            accepted.set()

        b.client._accept = raw_accept
        stream, buf, nonce = await a.client._open()
        await stream.send_all(p.connect(a.identity, nonce, b.peer_id).encode())
        assert (await read_reply(stream, buf)).type == p.SPLICED
        await accepted.wait()
        await stream.send_all(b"hello")
        assert await raw_b[0].receive_some(100) == b"hello"
        t0 = trio.current_time()
        assert await read_all(raw_b[0]) == b""  # the relay ends the circuit when idle
        assert 29.0 <= trio.current_time() - t0 <= 31.0
        assert server.stats()["circuits_open"] == 0
        nursery.cancel_scope.cancel()


async def test_direct_path_replaces_the_relayed_one_without_losing_a_byte(sim_env, autojump_clock):
    env = sim_env
    async with trio.open_nursery() as nursery:
        _, address, _captured = await start_relay(
            env, nursery, RelayLimits(rate_bytes_per_s=4 << 20)
        )
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        a.transport.blocked.add("b")
        b.transport.blocked.add("a")
        relayed = await a.client.dial(b.peer_id)
        stream = await a.overlay.open_stream(b.peer_id, "bulk")
        chunks = [hashlib.sha256(bytes([i])).digest() * 4096 for i in range(64)]  # 8 MiB

        async def transfer():
            await hash_exchange(stream, chunks)

        async with trio.open_nursery() as inner:
            inner.start_soon(transfer)
            await trio.sleep(0.5)
            a.transport.blocked.clear()
            direct = await a.overlay.dial(
                b.overlay.listen_addresses[0], peer_id=b.peer_id, replace=True
            )
            assert direct.path == DIRECT and a.overlay.connection(b.peer_id) is direct
            assert stream.connection is relayed and relayed.draining
        await relayed.wait_closed()
        assert relayed.close_reason == "replaced"
        assert stream.connection.path == RELAYED
        nursery.cancel_scope.cancel()


async def test_a_circuit_refused_for_too_many_handshakes_ends_only_that_circuit(env, clock):
    """The overlay refuses a circuit when too many inbound handshakes are pending: that
    circuit ends, the relay client goes on taking the next ones."""
    async with trio.open_nursery() as nursery:
        _server, address, _ = await start_relay(env, nursery)
        a = await start_agent(env, nursery, "a", address)
        b = await start_agent(env, nursery, "b", address)
        adopt = b.overlay.adopt

        async def busy(stream, **kw):
            await trio.aclose_forcefully(stream)
            raise ConnectionUnavailable("refused: 16 inbound handshakes are already in progress")

        b.overlay.adopt = busy
        with trio.fail_after(30), pytest.raises(Exception):  # noqa: B017 - how a dial fails varies
            await a.client.dial(b.peer_id)
        b.overlay.adopt = adopt
        with trio.fail_after(30):
            conn = await a.client.dial(b.peer_id)
        assert conn.path == RELAYED and conn.peer_id == b.peer_id
        nursery.cancel_scope.cancel()
