"""Acceptance 1: peers of one mesh connect; misbehaving peers are refused with a logged
reason while the listener keeps serving others. Over real TCP and the simulated network."""

import pytest
import trio
from structlog.testing import capture_logs

from meshagent.net.errors import DialError
from meshagent.net.secure import secure_handshake
from meshagent.wire.frames import OpenFrame, encode_frame
from tests.net.support import (
    OTHER_MESH,
    Recorder,
    TamperingProxy,
    hash_exchange,
    honest_handshake,
    local_peer,
    node,
    quick,
    wait_closed_by_peer,
)


async def test_agents_of_one_mesh_connect_and_stream_both_ways(env, clock):
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, listen=False) as (a, _),
        node(env, "b", nursery) as (b, b_addr),
    ):
        with trio.fail_after(30):
            conn = await a.dial(b_addr, peer_id=b.peer_id)
            assert conn.peer_id == b.peer_id
            server_side = await b.wait_connected(a.peer_id)
            assert server_side.session_id == conn.session_id
            await hash_exchange(await a.open_stream(b.peer_id, "up"), [b"x" * 300_000, b"y"])
            # Streams the listening side opens travel the same connection the other way.
            await hash_exchange(await b.open_stream(a.peer_id, "down"), [b"z" * 70_000])
            while not conn.rtt.samples:
                await trio.sleep(0.01)
        assert conn.rtt.latest is not None and conn.rtt.smoothed is not None
        assert [link.peer_id for link in a.links()] == [b.peer_id]
        nursery.cancel_scope.cancel()


def refusals(logs):
    return [e for e in logs if e["event"] in ("handshake.refused", "conn.protocol_error")]


async def attack_wrong_secret(env, b_addr, b):
    outsider = local_peer(OTHER_MESH)
    async with (
        trio.open_nursery() as nursery,
        node(env, "mallory", nursery, listen=False, local=outsider) as (m, _),
    ):
        # Refused at once and not retried: the responder says it is another mesh.
        with pytest.raises(DialError, match="different mesh secret"), trio.fail_after(2):
            await m.dial(b_addr)
        nursery.cancel_scope.cancel()
    return "not a member of this mesh"


async def attack_replayed_handshake(env, b_addr, b):
    # An eavesdropper captured a genuine client's handshake bytes and replays them.
    genuine = local_peer()
    recorder = Recorder(await env.transport("alice").dial(b_addr))
    await secure_handshake(recorder, genuine, initiator=True, timeout=10)
    await trio.aclose_forcefully(recorder)
    replay = await env.transport("mallory").dial(b_addr)
    await replay.send_all(bytes(recorder.sent))
    await wait_closed_by_peer(replay)
    return "replayed handshake"


async def attack_tampered_frame(env, b_addr, b):
    proxy = TamperingProxy(env, "proxy", b_addr)
    async with trio.open_nursery() as nursery:
        proxy_addr = await nursery.start(proxy.run)
        async with node(env, "alice", nursery, listen=False) as (alice, _):
            conn = await alice.dial(proxy_addr)
            with trio.fail_after(30):
                await conn.wait_closed()
            assert "failed authentication" in conn.close_reason
        nursery.cancel_scope.cancel()
    assert proxy.tampered
    return "failed authentication"


async def attack_plaintext_frame(env, b_addr, b):
    stream, _, _ = await honest_handshake(env, "mallory", b_addr, local_peer())
    frame = encode_frame(OpenFrame(1, 1000, 10, "plain"))
    await stream.send_all(len(frame).to_bytes(4, "big") + frame)
    await wait_closed_by_peer(stream)
    return "failed authentication"


async def attack_plaintext_instead_of_handshake(env, b_addr, b):
    stream = await env.transport("mallory").dial(b_addr)
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: mesh\r\n\r\n")
    await wait_closed_by_peer(stream)
    return "not speaking the meshagent overlay protocol"


async def attack_oversized_frame(env, b_addr, b):
    stream, _, sealer = await honest_handshake(env, "mallory", b_addr, local_peer())
    await stream.send_all(sealer.seal(encode_frame(OpenFrame(1, 1000, 10))))
    await stream.send_all((64 << 20).to_bytes(4, "big") + b"\x00" * 1000)
    await wait_closed_by_peer(stream)
    return "exceeds the maximum"


async def attack_silence(env, b_addr, b):
    stream = await env.transport("mallory").dial(b_addr)
    await wait_closed_by_peer(stream)  # the listener gives up after its handshake timeout
    return "timed out"


ATTACKS = {
    "wrong_secret": attack_wrong_secret,
    "replayed_handshake": attack_replayed_handshake,
    "tampered_frame": attack_tampered_frame,
    "plaintext_frame": attack_plaintext_frame,
    "plaintext_handshake": attack_plaintext_instead_of_handshake,
    "oversized_frame": attack_oversized_frame,
    "silent": attack_silence,
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_misbehaving_peer_is_refused_with_a_logged_reason(env, clock, attack):
    config = quick(handshake_timeout=1.0)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, addr):
        with capture_logs() as logs, trio.fail_after(60):
            expected = await ATTACKS[attack](env, addr, b)
            while not refusals(logs):
                await trio.sleep(0.01)
        reasons = [e["reason"] for e in refusals(logs)]
        assert any(expected in r for r in reasons), reasons
        # The listener keeps serving others.
        async with node(env, "alice", nursery, listen=False) as (alice, _):
            with trio.fail_after(60):
                await alice.dial(addr, peer_id=b.peer_id)
                await hash_exchange(await alice.open_stream(b.peer_id), [b"after" * 1000])
        # Nobody that misbehaved is left connected.
        assert {c.peer_id for c in b.connections()} <= {alice.peer_id}
        nursery.cancel_scope.cancel()


async def test_listener_survives_many_bad_peers_at_once(env, clock):
    async def garbage(address, i):
        stream = await env.transport(f"m{i}").dial(address)
        await stream.send_all(bytes([i]) * (i * 37 + 1))
        await wait_closed_by_peer(stream)

    config = quick(handshake_timeout=1.0)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, addr):
        with trio.fail_after(60):
            async with trio.open_nursery() as attackers:
                for i in range(20):
                    attackers.start_soon(garbage, addr, i)
            async with node(env, "alice", nursery, listen=False) as (alice, _):
                await alice.dial(addr)
                await hash_exchange(await alice.open_stream(b.peer_id), [b"ok"])
        nursery.cancel_scope.cancel()


async def test_dial_refuses_an_unexpected_peer(env, clock):
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery) as (_, b_addr),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        with pytest.raises(DialError, match="dialed peer"):
            await a.dial(b_addr, peer_id=local_peer().peer_id)
        nursery.cancel_scope.cancel()


async def test_pending_handshakes_are_bounded(sim_env, autojump_clock):
    env = sim_env
    config = quick(handshake_timeout=5.0, max_pending_handshakes=2)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, addr):
        with capture_logs() as logs:
            silent = [await env.transport(f"s{i}").dial(addr) for i in range(3)]
            with trio.fail_after(1):
                await wait_closed_by_peer(silent[2])  # refused at once, not after 5 s
        assert any(e.get("reason") == "too many pending handshakes" for e in logs)
        for stream in silent[:2]:
            await wait_closed_by_peer(stream)
        async with node(env, "alice", nursery, listen=False) as (alice, _):
            await alice.dial(addr)
            await hash_exchange(await alice.open_stream(b.peer_id), [b"room again"])
        nursery.cancel_scope.cancel()
