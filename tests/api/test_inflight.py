import trio
import trio.testing

from meshagent.api.inflight import InFlight


async def test_drain_waits_for_requests_within_the_grace(autojump_clock):
    inflight = InFlight()
    finished = []

    async def request(duration: float) -> None:
        with inflight.track() as scope, scope:
            await trio.sleep(duration)
            finished.append(duration)

    async with trio.open_nursery() as n:
        n.start_soon(request, 3.0)
        n.start_soon(request, 5.0)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        assert await inflight.drain(10.0) == 0
        assert trio.current_time() - start == 5.0
    assert sorted(finished) == [3.0, 5.0]


async def test_drain_stops_requests_that_outlive_the_grace(autojump_clock):
    inflight = InFlight()
    outcome = []

    async def request() -> None:
        with inflight.track() as scope:
            with scope:
                await trio.sleep(100)
            outcome.append("stopped" if scope.cancelled_caught else "done")

    async with trio.open_nursery() as n:
        n.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        assert await inflight.drain(2.0) == 1
        assert trio.current_time() - start == 2.0
    assert outcome == ["stopped"]
    assert len(inflight) == 0
