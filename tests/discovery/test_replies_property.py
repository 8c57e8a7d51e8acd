"""What a peer answers to `hear/1` and `probe/1`, generated: an answer out of its range is
refused with the decoder's error naming it, never read as a value, and no answer makes the
asker raise anything else."""

from __future__ import annotations

import contextlib
import math
import struct

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from meshagent.discovery import hearing, probe
from tests.net.support import node

U32, U64 = (1 << 32) - 1, (1 << 64) - 1

# ----- hear/1: u32 milliseconds, NO_LINK for none -------------------------------------------


@given(st.binary(max_size=12).filter(lambda b: len(b) != 4))
def test_a_hear_answer_of_another_length_is_refused_naming_it(data):
    with pytest.raises(hearing.HearingError, match=f"not {len(data)}"):
        hearing.parse(data)


@given(st.integers(0, U32))
def test_every_four_byte_hear_answer_is_seconds_or_no_link(ms):
    heard = hearing.parse(struct.pack(">I", ms))
    assert heard is None if ms == hearing.NO_LINK else 0 <= heard < (1 << 32) / 1000


@given(st.binary(max_size=12))
def test_any_hear_answer_is_read_or_a_hearing_error(data):
    with contextlib.suppress(hearing.HearingError):
        hearing.parse(data)


@given(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(2**70), 2**70).map(float),
        st.sampled_from([-1.0, -1e-9, 1e300, math.inf, -math.inf, math.nan]),
    )
)
def test_any_silence_makes_an_answer_that_reads_back(silent_s):
    """A clock that steps back, or a silence past what a u32 holds, is an answer still."""
    heard = hearing.parse(hearing.reply(silent_s))
    assert heard is not None and 0 <= heard < hearing.NO_LINK / 1000


# ----- probe/1: sha256 and a u64 byte count -------------------------------------------------

DIGEST = bytes(32)


@given(st.integers(probe.MAX_BYTES + 1, U64))
def test_a_probe_reply_counting_more_than_any_probe_carries_is_refused(count):
    with pytest.raises(probe.ProbeError, match=str(count)):
        probe.read_reply(struct.pack(">32sQ", DIGEST, count))


@given(st.binary(max_size=100).filter(lambda b: len(b) != 40))
def test_a_probe_reply_of_another_length_is_refused_naming_it(data):
    with pytest.raises(probe.ProbeError, match=f"{len(data)} bytes"):
        probe.read_reply(data)


@given(st.binary(min_size=32, max_size=32), st.integers(0, probe.MAX_BYTES))
def test_a_probe_reply_within_range_is_its_digest_and_count(digest, count):
    assert probe.read_reply(struct.pack(">32sQ", digest, count)) == (digest, count)


@given(st.binary(max_size=100))
def test_any_probe_reply_is_read_or_a_probe_error(data):
    with contextlib.suppress(probe.ProbeError):
        _, count = probe.read_reply(data)
        assert 0 <= count <= probe.MAX_BYTES


def replying(answer: bytes):
    """A probe/1 peer that reads the probe and answers `answer`."""

    async def serve(stream) -> None:
        while await stream.receive_some():
            pass
        await stream.send_all(answer)
        await stream.send_eof()

    return serve


@pytest.mark.parametrize(
    "answer",
    [
        struct.pack(">32sQ", DIGEST, probe.MAX_BYTES + 1),
        struct.pack(">32sQ", DIGEST, U64),
        b"",
        bytes(39),
        bytes(41),
        bytes(4096),
    ],
    ids=["count-past-max", "count-u64-max", "empty", "short", "long", "flood"],
)
async def test_a_probe_answered_out_of_range_fails_with_a_probe_error(
    sim_env, autojump_clock, answer
):
    async with (
        trio.open_nursery() as nursery,
        node(sim_env, "a", nursery) as (a, _),
        node(sim_env, "b", nursery, on_stream=replying(answer)) as (b, b_addr),
    ):
        await a.dial(b_addr)
        with pytest.raises(probe.ProbeError, match=b.peer_id[:12]):
            await probe.probe(a, b.peer_id, total=1000)
        nursery.cancel_scope.cancel()
