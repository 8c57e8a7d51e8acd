"""A request's recovery: it waits for something that serves the model again, woken by
changes, gives up at its deadline with the reason, and says what each loss cost; `Rerouting`
finds the runner after a lost chain, hands the request on when the mesh moved the model, and
interrupts a split's requests once its plan stops being routable; the directory's offer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from meshagent.errors import ModelMoved, SplitUnavailable
from meshagent.gossip.failure import PeerState
from meshagent.placement.planner import Plan, StageAssignment
from meshagent.serving.mesh_directory import MeshDirectory
from meshagent.serving.recovery import GaveUp, Recovery, Rerouting, Route
from meshagent.serving.settings import ServingSettings

SPLIT = Plan("m", 256, stages=(StageAssignment("a", 0, 10), StageAssignment("b", 10, 30)))


class Changes:
    """A change to wait on, made by the test."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.waits = 0

    async def wait(self) -> None:
        self.waits += 1
        await self.event.wait()

    def happen(self) -> None:
        self.event.set()
        self.event = trio.Event()


async def test_a_recovery_waits_for_a_change_not_a_timer_and_says_what_the_loss_cost(
    autojump_clock,
):
    changes, found = Changes(), []
    recovery = Recovery(30.0, changed=changes.wait)
    recovery.broke("a stage's peer is gone")
    async with trio.open_nursery() as nursery:

        async def later():
            await trio.sleep(5)
            found.append("the new chain")
            changes.happen()

        nursery.start_soon(later)
        got = await recovery.until(lambda: found[0] if found else None)
    assert got == "the new chain" and changes.waits == 1  # one look per change
    await trio.sleep(1)  # the first token of the replay comes a second later
    recovery.served(42)
    [replay] = recovery.replays
    assert (replay.reason, replay.tokens, replay.ms, replay.wait_ms) == (
        "a stage's peer is gone",
        42,
        6000.0,
        5000.0,
    )
    recovery.served(43)  # no loss open: nothing more to say
    assert len(recovery.replays) == 1


async def test_nothing_serving_within_the_deadline_fails_with_the_last_reason(autojump_clock):
    recovery = Recovery(3.0, changed=Changes().wait)
    recovery.broke("a stage's peer is gone")
    recovery.broke("reconnecting failed: connection refused")
    with pytest.raises(GaveUp, match=r"connection refused \(no chain served .* within 3 s\)"):
        await recovery.until(lambda: None)
    assert trio.current_time() == pytest.approx(3.0)


async def test_tries_of_a_chain_that_is_not_back_pause_longer_each_time(autojump_clock):
    recovery = Recovery(30.0)
    recovery.broke("lost")
    starts = []
    for _ in range(5):
        await recovery.pause()
        starts.append(trio.current_time())
    gaps = [round(b - a, 2) for a, b in zip([0.0, *starts], starts, strict=False)]
    assert gaps == [0.0, 0.25, 0.5, 1.0, 2.0]


async def test_without_routes_a_lost_chain_fails_at_once():
    error = SplitUnavailable("the split pipeline failed: gone")
    with pytest.raises(SplitUnavailable) as raised:
        await Recovery(30.0).after(error, 10)
    assert raised.value is error


class FakePlacement:
    def __init__(self, peers) -> None:
        self.routable = False
        self.in_force = None
        self.changed = trio.Event()
        self.error, self.error_since = None, 0.0
        self.ready = ()
        self.views = {p: SimpleNamespace(state=PeerState.ALIVE) for p in peers}
        self.gossip = SimpleNamespace(snapshot=lambda: self.views)

    def decide(self, plan: Plan | None, routable: bool) -> None:
        self.in_force = None if plan is None else SimpleNamespace(plan=plan)
        self.routable = routable
        self.changed.set()
        self.changed = trio.Event()


def local_model():
    runner = SimpleNamespace(aborted=None)
    return SimpleNamespace(runner=runner, engine=SimpleNamespace(token_bytes=bytes))


def directory(placement) -> MeshDirectory:
    info = SimpleNamespace(id="m")
    layout = SimpleNamespace(n_layers=30)
    return MeshDirectory(
        peer_id="a",
        info=info,
        layout=layout,
        placement=placement,
        overlay=None,
        settings=ServingSettings(replay_deadline=30.0),
    )


async def test_rerouting_finds_the_runner_once_the_plan_serves_again(autojump_clock):
    placement = FakePlacement("ab")
    offered = directory(placement)
    rerouting = Rerouting("a", placement, offered)
    model = local_model()
    offered.offer(model, [], SPLIT)
    assert rerouting.route() is None  # the plan is not routable
    placement.views["b"].state = PeerState.DEAD
    placement.decide(SPLIT, routable=True)
    route = rerouting.route()
    assert isinstance(route, Route) and route.runner is model.runner
    assert route.lost == ("b:10-30",)
    model.runner.aborted = ModelMoved("unloaded")
    assert rerouting.route() is None  # a runner that stopped serves nothing


async def test_a_request_is_handed_on_when_the_mesh_moved_the_model_elsewhere():
    placement = FakePlacement("abc")
    rerouting = Rerouting("a", placement, directory(placement))
    placement.decide(Plan("m", 256, replicas=("b", "c")), routable=True)
    with pytest.raises(ModelMoved):
        rerouting.route()
    placement.decide(Plan("m", 256, replicas=("a", "b")), routable=True)
    assert rerouting.route() is None  # this agent is a replica: its part is loading


async def test_a_replay_waits_on_the_directory_and_resumes_when_the_part_is_offered(
    autojump_clock,
):
    placement = FakePlacement("ab")
    offered = directory(placement)
    rerouting = Rerouting("a", placement, offered)
    recovery = Recovery(30.0, routes=rerouting)
    model = local_model()
    async with trio.open_nursery() as nursery:

        async def repaired():
            await trio.sleep(2)
            placement.decide(SPLIT, routable=True)
            await trio.sleep(1)
            offered.offer(model, [(b"x-meshagent-stages", b"a:0-10,b:10-30")], SPLIT)

        nursery.start_soon(repaired)
        route = await recovery.after(SplitUnavailable("gone"), 12)
    assert route.runner is model.runner and trio.current_time() == pytest.approx(3.0)


async def test_a_split_is_interrupted_when_its_plan_stops_being_routable(autojump_clock):
    placement = FakePlacement("ab")
    rerouting = Rerouting("a", placement, directory(placement))
    said = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rerouting.watch, said.append)
        await trio.sleep(1)
        placement.decide(SPLIT, routable=True)
        await trio.sleep(1)
        assert said == []
        placement.decide(SPLIT, routable=False)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert said == ["the split lost a stage (its peer is gone or left the plan)"]


async def test_the_directory_keeps_the_plan_it_replaced_for_a_replays_deadline(autojump_clock):
    placement = FakePlacement("ab")
    offered = directory(placement)
    model = local_model()
    whole = Plan("m", 256, replicas=("a",))
    offered.offer(model, [(b"x-meshagent-stages", b"a:0-30")], whole)
    assert offered.local_models() == [model] and offered.receipt(model)
    offered.offer(model, [], SPLIT)
    assert offered.plans == [SPLIT, whole]
    await trio.sleep(31)
    assert offered.plans == [SPLIT]
    offered.withdraw()
    assert offered.local_models() == [] and offered.receipt(model) == []


async def test_the_directory_wakes_on_an_offer_and_on_a_placement_decision(autojump_clock):
    placement = FakePlacement("ab")
    offered = directory(placement)
    woken = []
    for change in (lambda: offered.withdraw(), lambda: placement.decide(None, False)):
        async with trio.open_nursery() as nursery:

            async def wait():
                await offered.changed()
                woken.append(trio.current_time())

            nursery.start_soon(wait)
            await trio.sleep(1)
            change()
    assert woken == [pytest.approx(1.0), pytest.approx(2.0)]  # at once, not at a poll
