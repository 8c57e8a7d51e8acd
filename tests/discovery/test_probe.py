"""`probe/1` on the simulated network: a probe checks every byte, is bounded in size and time
at both ends, and never waits on a peer for ever."""

from __future__ import annotations

import pytest
import trio

from meshagent.discovery import probe
from meshagent.net.errors import StreamResetError
from tests.net.support import node


async def _silent(stream) -> None:
    """Reads the whole probe, then never replies."""
    while await stream.receive_some():
        pass
    await trio.sleep_forever()


async def test_a_probe_arrives_whole_and_is_verified(sim_env, autojump_clock):
    async with (
        trio.open_nursery() as nursery,
        node(sim_env, "a", nursery) as (a, _),
        node(sim_env, "b", nursery, on_stream=probe.serve) as (b, b_addr),
    ):
        await a.dial(b_addr)
        result = await probe.probe(a, b.peer_id, total=300_000, seconds=2.0)
        assert result["ok"] and result["bytes_received_by_peer"] == 300_000
        assert result["seconds"] >= 1.5  # paced: the last chunk leaves at 4/5 of the time
        nursery.cancel_scope.cancel()


async def test_a_peer_that_never_replies_fails_the_probe_within_its_deadline(
    sim_env, autojump_clock
):
    async with (
        trio.open_nursery() as nursery,
        node(sim_env, "a", nursery) as (a, _),
        node(sim_env, "b", nursery, on_stream=_silent) as (b, b_addr),
    ):
        await a.dial(b_addr)
        started = trio.current_time()
        with trio.fail_after(probe.REPLY_DEADLINE + probe.SLACK + 60):
            with pytest.raises(probe.ProbeTimeout, match="waiting for the reply"):
                await probe.probe(a, b.peer_id, total=10_000)
        assert trio.current_time() - started == pytest.approx(probe.REPLY_DEADLINE, abs=1)
        nursery.cancel_scope.cancel()


async def test_a_probe_that_never_ends_is_reset_by_the_peer(sim_env, autojump_clock):
    async with (
        trio.open_nursery() as nursery,
        node(sim_env, "a", nursery) as (a, _),
        node(sim_env, "b", nursery, on_stream=probe.serve) as (b, b_addr),
    ):
        await a.dial(b_addr)
        stream = await a.open_stream(b.peer_id, probe.LABEL)
        await stream.send_all(b"x" * 1000)  # and never an end
        with trio.fail_after(probe.MAX_SECONDS + probe.SLACK + 30):
            with pytest.raises(StreamResetError, match="not ended within"):
                await stream.receive_some()
        nursery.cancel_scope.cancel()


def test_a_probe_is_bounded_before_it_is_sent():
    probe.check(probe.MAX_BYTES, probe.MAX_SECONDS)
    for total, seconds in (
        (0, 0.0),
        (probe.MAX_BYTES + 1, 0.0),
        (1 << 30, 0.0),
        (1, -1.0),
        (1, probe.MAX_SECONDS + 1),
        (1, float("nan")),
        (1, float("inf")),
    ):
        with pytest.raises(probe.ProbeError):
            probe.check(total, seconds)
