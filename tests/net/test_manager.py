"""Connection manager: one connection per peer, deterministic simultaneous dial, dial
backoff, dead-peer detection, stream handler failures, shutdown."""

import hashlib
from dataclasses import dataclass
from functools import partial

import pytest
import trio
import trio.testing
from structlog.testing import capture_logs

from meshagent.net.address import Address
from meshagent.net.backoff import Backoff
from meshagent.net.connection import DIRECT, RELAYED
from meshagent.net.errors import ConnectionUnavailable, DialError, StreamResetError, reset_reasons
from meshagent.net.manager import ConnectionManager, choose_connection
from meshagent.testing.sim_network import LinkSpec
from meshagent.wire.errors import ErrorCode
from tests.net.support import (
    NetEnv,
    hash_exchange,
    hash_reply,
    honest_handshake,
    local_peer,
    node,
    quick,
    read_all,
)


@dataclass
class FakeConn:
    path: str = DIRECT
    remote_incarnation: bytes = b"1"
    initiator_peer_id: str = "a"


@pytest.mark.parametrize(
    ("current", "new", "keep_new"),
    [
        (FakeConn(path=RELAYED), FakeConn(path=DIRECT), True),  # direct replaces relayed
        (FakeConn(path=DIRECT), FakeConn(path=RELAYED), False),
        (FakeConn(remote_incarnation=b"old"), FakeConn(remote_incarnation=b"new"), True),
        (FakeConn(initiator_peer_id="a"), FakeConn(initiator_peer_id="b"), False),
        (FakeConn(initiator_peer_id="b"), FakeConn(initiator_peer_id="a"), True),
        (FakeConn(initiator_peer_id="a"), FakeConn(initiator_peer_id="a"), True),  # reconnect
    ],
)
def test_choose_connection_rules(current, new, keep_new):
    keep, why = choose_connection(current, new)
    assert (keep is new) == keep_new and why


async def test_simultaneous_dial_leaves_one_connection_both_sides_agree(env, clock):
    if env.kind == "sim":  # 20 ms each way: the two dials surely cross
        env = NetEnv("sim", LinkSpec(latency=0.020))
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery) as (a, a_addr),
        node(env, "b", nursery) as (b, b_addr),
    ):
        with trio.fail_after(30):
            async with trio.open_nursery() as dials:
                dials.start_soon(a.dial, b_addr)
                dials.start_soon(b.dial, a_addr)
            # Settled: the two sides agree on one connection and the other one is gone.
            while not (
                len(a.connections()) == len(b.connections()) == 1
                and a.connection(b.peer_id).session_id == b.connection(a.peer_id).session_id
            ):
                await trio.sleep(0.01)
            kept_a = a.connection(b.peer_id)
            assert kept_a.initiator_peer_id == min(a.peer_id, b.peer_id)
            await hash_exchange(await a.open_stream(b.peer_id), [b"one connection"])
            await hash_exchange(await b.open_stream(a.peer_id), [b"both ways"])
        nursery.cancel_scope.cancel()


async def test_dial_retries_with_backoff_until_the_peer_listens(autojump_clock):
    env = NetEnv("sim")
    backoff = Backoff(initial=0.5, factor=2.0, jitter=0.0, attempts=6)
    config = quick(dial_backoff=backoff)
    target = Address("b", 7000)
    async with trio.open_nursery() as nursery:
        a = ConnectionManager(local_peer(), env.transport("a"), config=config)
        b = ConnectionManager(local_peer(), env.transport("b"), listen=[target])
        await nursery.start(a.run)

        async def late_start():
            await trio.sleep(2.2)
            await nursery.start(b.run)

        nursery.start_soon(late_start)
        start = trio.current_time()
        conn = await a.dial(target, peer_id=b.peer_id)
        # Attempts at 0, 0.5, 1.5 and 3.5 s; the last one finds the listener.
        assert conn.peer_id == b.peer_id
        assert 3.5 <= trio.current_time() - start < 3.6
        nursery.cancel_scope.cancel()


async def test_dial_gives_up_after_its_attempts(autojump_clock):
    env = NetEnv("sim")
    config = quick(dial_backoff=Backoff(initial=1.0, factor=2.0, jitter=0.0, attempts=4))
    async with trio.open_nursery() as nursery:
        a = ConnectionManager(local_peer(), env.transport("a"), config=config)
        await nursery.start(a.run)
        start = trio.current_time()
        with pytest.raises(DialError, match="after 4 attempts"):
            await a.dial("nobody:1")
        assert 7.0 <= trio.current_time() - start < 7.1  # 1 + 2 + 4
        nursery.cancel_scope.cancel()


def test_backoff_schedule_is_bounded_and_jittered():
    import random

    delays = list(
        Backoff(initial=1, factor=3, maximum=5, jitter=0.1, attempts=5).delays(random.Random(1))
    )
    assert len(delays) == 4
    for got, base in zip(delays, [1, 3, 5, 5], strict=True):
        assert base * 0.9 <= got <= base * 1.1


async def test_a_peer_that_stops_answering_pings_is_dropped(autojump_clock):
    env = NetEnv("sim")
    config = quick(ping_interval=5.0, dead_peer_timeout=20.0)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, addr):
        with capture_logs() as logs:
            # A zombie: completes the handshake, then neither reads nor writes.
            zombie = local_peer()
            stream, _, _ = await honest_handshake(env, "zombie", addr, zombie)
            start = trio.current_time()
            with trio.fail_after(60):
                conn = await b.wait_connected(zombie.peer_id)
                await conn.wait_closed()
        assert conn.close_code == ErrorCode.UNRESPONSIVE
        assert 20.0 <= trio.current_time() - start <= 30.0
        assert any(e["event"] == "conn.unresponsive" for e in logs)
        await trio.aclose_forcefully(stream)
        nursery.cancel_scope.cancel()


async def test_failing_stream_handler_resets_only_its_stream(env, clock):
    async def handler(stream):
        if stream.label == "boom":
            raise RuntimeError("model not loaded")
        from tests.net.support import hash_reply

        await hash_reply(stream)

    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery, on_stream=handler) as (b, addr),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        with trio.fail_after(30):
            await a.dial(addr)
            boom = await a.open_stream(b.peer_id, "boom")
            with pytest.raises(StreamResetError, match="model not loaded") as info:
                await read_all(boom)
            assert info.value.code == ErrorCode.INTERNAL_ERROR and info.value.by_peer
            await hash_exchange(await a.open_stream(b.peer_id, "fine"), [b"still works"])
        nursery.cancel_scope.cancel()


async def test_shutdown_drains_and_says_why(env, clock):
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery) as (b, addr),
        node(env, "a", nursery, listen=False) as (a, _),
    ):
        with trio.fail_after(30):
            conn = await a.dial(addr)
            await a.aclose(grace=1.0)
            assert conn.close_reason == "shutdown"
            while b.connection(a.peer_id) is not None:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


async def test_dialing_ourselves_is_refused(env, clock):
    async with trio.open_nursery() as nursery, node(env, "a", nursery) as (a, addr):
        with pytest.raises(DialError, match="this node itself"), trio.fail_after(30):
            await a.dial(addr)
        assert a.connections() == []
        nursery.cancel_scope.cancel()


async def test_relayed_inbound_handshakes_are_bounded_like_a_listeners(autojump_clock):
    # Streams from a relay splice that never finish their handshake: beyond the limit, the
    # next one is refused at once (and closed); the pending ones time out and free their place.
    env = NetEnv("sim")
    config = quick(max_pending_handshakes=2, handshake_timeout=5.0)
    async with trio.open_nursery() as nursery, node(env, "b", nursery, config=config) as (b, _):
        ends = [trio.testing.memory_stream_pair() for _ in range(3)]
        failures: list[BaseException] = []

        async def adopt(stream) -> None:
            try:
                await b.adopt(stream, initiator=False, remote="relay r")
            except Exception as e:
                failures.append(e)

        with capture_logs() as logs:
            for ours, _theirs in ends[:2]:
                nursery.start_soon(adopt, ours)
            await trio.sleep(0.1)
            with pytest.raises(ConnectionUnavailable, match="inbound handshakes"):
                await b.adopt(ends[2][0], initiator=False, remote="relay r")
            assert await ends[2][1].receive_some() == b""  # closed, not left hanging
            await trio.sleep(6)
        assert len(failures) == 2  # both pending handshakes timed out...
        assert any(e["event"] == "handshake.refused" for e in logs)
        ours, _theirs = trio.testing.memory_stream_pair()
        nursery.start_soon(adopt, ours)
        await trio.sleep(0.1)
        assert len(failures) == 2  # ...and a new one is admitted again
        nursery.cancel_scope.cancel()


async def test_a_crashed_peer_is_reported_lost_and_nothing_listens_where_it_did(env, clock):
    lost = []
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_lost=lost.append) as (a, _),
    ):
        async with trio.open_nursery() as b_nursery, node(env, "b", b_nursery) as (b, b_addr):
            await a.dial(b_addr)
            assert await a.listening_at(b_addr, timeout=5) is True
            b_nursery.cancel_scope.cancel()  # b's process dies: no BYE, its listener gone
        with trio.fail_after(10):
            while not lost:
                await trio.sleep(0.01)
        [conn] = lost
        assert conn.peer_id == b.peer_id and conn.lost
        assert await a.listening_at(b_addr, timeout=5) is False
        nursery.cancel_scope.cancel()


async def test_a_peer_that_closes_on_purpose_is_not_reported_lost(env, clock):
    lost = []
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_lost=lost.append) as (a, _),
        node(env, "b", nursery) as (b, b_addr),
    ):
        conn = await a.dial(b_addr)
        await (await b.wait_connected(a.peer_id)).aclose(reason="done")  # BYE
        with trio.fail_after(10):
            await conn.wait_closed()
        await trio.sleep(0.1)
        assert lost == [] and not conn.lost
        nursery.cancel_scope.cancel()


async def _frozen_path(env: NetEnv, nursery: trio.Nursery, to: Address):
    """An address that reaches `to`, and a function that makes that path go silent both
    ways (no reset, no EOF): a simulated cut, or on TCP a proxy that stops forwarding."""
    if env.sim is not None:
        return to, lambda: env.sim.cut("a", "b")
    frozen = trio.Event()

    async def pump(src, dst):
        while data := await src.receive_some(65536):
            if frozen.is_set():
                await trio.sleep_forever()
            await dst.send_all(data)

    async def handler(client):
        upstream = await trio.open_tcp_stream(to.host, to.port)
        async with trio.open_nursery() as pumps:
            pumps.start_soon(pump, client, upstream)
            pumps.start_soon(pump, upstream, client)

    [listener] = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return Address("127.0.0.1", listener.socket.getsockname()[1]), frozen.set


async def test_a_peer_that_stops_answering_is_reported_silent_once(env, clock):
    silent = []
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery, on_silent=silent.append) as (a, _),
        node(env, "b", nursery) as (_b, b_addr),
    ):
        address, freeze = await _frozen_path(env, nursery, b_addr)
        conn = await a.dial(address)
        await trio.sleep(3)  # pings answered: nothing to report
        assert silent == []
        freeze()
        frozen_at = trio.current_time()
        with trio.fail_after(5):
            while not silent:
                await trio.sleep(0.01)
        assert silent == [conn] and conn.silent_for() > conn.config.silent_after
        assert trio.current_time() - frozen_at < conn.config.silent_after + 1.0
        await trio.sleep(3)
        assert silent == [conn]  # once per silence, and the connection is left to the caller
        assert not conn.is_closed
        nursery.cancel_scope.cancel()


async def test_a_peer_that_stops_reading_holds_at_most_the_connection_window(env, clock):
    # b accepts 8 streams and reads none of them. Each stream's window is 1 MiB, the
    # connection's 3 MiB: a's senders stop after 3 MiB in all, and wait (no error, no reset)
    # until b reads; then everything arrives.
    budget = 3 << 20
    stuck = trio.Event()
    accepted = []

    async def hold(stream):
        accepted.append(stream)
        await stuck.wait()
        await hash_reply(stream)

    b_local = local_peer(window_bytes=1 << 20, connection_window_bytes=budget)
    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery) as (a, _),
        node(env, "b", nursery, on_stream=hold, local=b_local) as (b, b_addr),
    ):
        await a.dial(b_addr)
        payload = bytes(range(256)) * 4096  # 1 MiB per stream, 8 MiB in all
        streams = [await a.open_stream(b.peer_id) for _ in range(8)]

        async def send(stream):
            await stream.send_all(payload)
            await stream.send_eof()

        async with trio.open_nursery() as senders:
            for s in streams:
                senders.start_soon(send, s)
            await trio.sleep(2)
            conn = b.connection(a.peer_id)
            held = sum(conn.mux.buffered(sid) for sid in conn.mux.open_stream_ids())
            assert budget - (512 << 10) <= held <= budget
            stuck.set()  # b reads now: every byte goes through
        replies = [await read_all(s) for s in streams]
        expected = hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "big")
        assert replies == [expected] * 8
        nursery.cancel_scope.cancel()


def test_a_handler_ended_by_resets_alone_is_routine_not_a_failure():
    # A stage's handler runs its upstream and downstream in a nursery: when a peer goes, it
    # ends with a group of resets. That is logged as a reset, not as a failed handler with a
    # traceback; a real error in the group still is one.
    reset = StreamResetError(3, ErrorCode.CANCEL, "closed by the application", by_peer=True)
    assert reset_reasons(reset) == str(reset)
    nested = ExceptionGroup("handler", [reset, ExceptionGroup("stage", [reset])])
    assert reset_reasons(nested) == f"{reset}; {reset}"
    assert reset_reasons(ExceptionGroup("handler", [reset, RuntimeError("a bug")])) is None
    assert reset_reasons(RuntimeError("a bug")) is None
