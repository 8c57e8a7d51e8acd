"""Acceptance 4: drain-and-close when a connection is replaced."""

import hashlib
import random

import pytest
import trio

from meshagent.net.errors import ConnectionUnavailable, StreamResetError
from meshagent.wire.errors import ErrorCode
from tests.net.support import hash_exchange, hash_reply, node, quick, read_all

MIB = 1 << 20
BASE = random.Random(7).randbytes(MIB)


def chunks(stream_index: int, count: int = 16):
    for j in range(count):
        k = (stream_index * count + j) * 7919 % MIB
        yield BASE[k:] + BASE[:k]


async def send_and_verify(stream, index, done):
    expected, total = hashlib.sha256(), 0
    for chunk in chunks(index):
        expected.update(chunk)
        total += len(chunk)
        await stream.send_all(chunk)
    await stream.send_eof()
    reply = await read_all(stream)
    assert reply == expected.digest() + total.to_bytes(8, "big"), f"stream {index} corrupted"
    done.append(index)


async def test_replaced_connection_drains_64_mib_in_flight_then_closes(env, clock):
    grace = 5.0
    config = quick(drain_grace=grace)
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery, config=config) as (b, b_addr),
        node(env, "a", nursery, listen=False, config=config) as (a, _),
    ):
        with trio.fail_after(120):
            old = await a.dial(b_addr, peer_id=b.peer_id)
            old_b = await b.wait_connected(a.peer_id)
            streams = [await a.open_stream(b.peer_id, f"bulk-{i}") for i in range(4)]
            done: list[int] = []
            async with trio.open_nursery() as transfers:
                for i, stream in enumerate(streams):
                    transfers.start_soon(send_and_verify, stream, i, done)
                while old_b.bytes_received < 8 * MIB:
                    await trio.sleep(0.001)
                replaced_at = trio.current_time()
                new = await a.dial(b_addr, peer_id=b.peer_id, replace=True)
                assert len(done) == 0, "the transfers should still be in flight"
                assert new is not old and a.connection(b.peer_id) is new
                assert old.draining and not old.accepting_streams
                with pytest.raises(ConnectionUnavailable):
                    await old.open_stream()
                # New streams use the new connection, from both sides.
                fresh = await a.open_stream(b.peer_id, "fresh")
                assert fresh.connection is new
                await hash_exchange(fresh, [b"new connection" * 1000])
                while b.connection(a.peer_id).session_id != new.session_id:
                    await trio.sleep(0.001)
                back = await b.open_stream(a.peer_id, "back")
                assert back.connection.session_id == new.session_id
            assert sorted(done) == [0, 1, 2, 3]  # every byte of the old streams, verified
            await old.wait_closed()
            await old_b.wait_closed()
        assert old.close_reason == "replaced" and old.close_code == ErrorCode.REPLACED
        assert old_b.close_reason == "replaced"
        assert old.closed_at - replaced_at <= grace
        assert not new.is_closed and a.connection(b.peer_id) is new
        assert [c.session_id for c in a.connections()] == [new.session_id]
        nursery.cancel_scope.cancel()


async def test_stream_still_open_when_the_grace_expires_is_reset_with_the_reason(env, clock):
    grace = 5.0 if env.kind == "sim" else 0.5
    peer_errors: list[StreamResetError] = []

    async def handler(stream):
        if stream.label != "stuck":
            return await hash_reply(stream)
        try:
            await stream.send_all(b"x" * (8 * MIB))  # the dialer never reads this
        except StreamResetError as e:
            peer_errors.append(e)

    config = quick(drain_grace=grace)
    async with (
        trio.open_nursery() as nursery,
        node(env, "b", nursery, config=config, on_stream=handler) as (b, b_addr),
        node(env, "a", nursery, listen=False, config=config) as (a, _),
    ):
        with trio.fail_after(60):
            old = await a.dial(b_addr, peer_id=b.peer_id)
            stuck = await a.open_stream(b.peer_id, "stuck")
            await stuck.send_eof()
            healthy = await a.open_stream(b.peer_id, "healthy")
            while old.mux.send_credit(stuck.stream_id) == (0, 0) or not b.connection(a.peer_id):
                await trio.sleep(0.001)
            old_b = b.connection(a.peer_id)
            replaced_at = trio.current_time()
            await a.dial(b_addr, peer_id=b.peer_id, replace=True)
            await hash_exchange(healthy, [b"finishes within the grace"])
            await old.wait_closed()
            await old_b.wait_closed()
            closed_after = trio.current_time() - replaced_at
            with pytest.raises(StreamResetError) as info:
                await read_all(stuck)
        err = info.value
        assert err.code == ErrorCode.REPLACED
        assert "drain grace expired" in err.reason and "replaced" in err.reason
        # The peer's handler learns the same reason (both ends drain the replaced connection
        # with the same grace, so either may be the one that resets first).
        assert [e.reason for e in peer_errors] == [err.reason]
        assert old.close_reason == old_b.close_reason == "replaced"
        assert grace - 0.1 <= closed_after <= grace + 1.0
        nursery.cancel_scope.cancel()
