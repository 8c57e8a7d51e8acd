"""`hear/1`: one peer asks another how long it has not heard from a third, over real TCP
and the simulated network."""

import pytest
import trio

from meshagent.discovery import hearing
from tests.net.support import NetEnv, node


def test_answers_round_trip_and_bad_ones_are_refused():
    assert hearing.parse(hearing.reply(1.234)) == pytest.approx(1.234)
    assert hearing.parse(hearing.reply(None)) is None
    assert hearing.parse(hearing.reply(1e9)) is not None  # clamped, never read as NO_LINK
    with pytest.raises(hearing.HearingError):
        hearing.parse(b"\x00\x01")


@pytest.mark.parametrize("kind", ["tcp", "sim"])
async def test_a_peer_says_how_long_it_has_not_heard_from_a_third(kind):
    env = NetEnv(kind)
    overlays = {}

    async def route(stream):
        await hearing.serve(overlays["b"], stream)

    async with (
        trio.open_nursery() as nursery,
        node(env, "a", nursery) as (a, _),
        node(env, "b", nursery, on_stream=route) as (b, b_addr),
        node(env, "c", nursery) as (c, c_addr),
    ):
        overlays["b"] = b
        await a.dial(b_addr)
        # b has no connection to c yet: it cannot say.
        assert await hearing.ask(a, b.peer_id, c.peer_id, timeout=5) is None
        await b.dial(c_addr)
        await trio.sleep(1.0)  # a few PINGs answered
        heard = await hearing.ask(a, b.peer_id, c.peer_id, timeout=5)
        assert heard is not None and heard < 1.0
        # A peer that does not serve hear/1 gives no answer, not an error.
        assert await hearing.ask(b, c.peer_id, a.peer_id, timeout=5) is None
        nursery.cancel_scope.cancel()
