"""Agents running PlacementService over a shared gossip view agree and take part once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import trio

from meshagent.errors import EngineError
from meshagent.placement.negotiation import plan_digest
from meshagent.placement.planner import ModelCost, Plan, StageAssignment, is_repair
from meshagent.placement.service import PlacementService

GB = 1_000_000_000
MODEL = ModelCost("m", 30, (100_000_000,) * 30, 50_000_000, 50_000_000, 0, 1000)


@dataclass(frozen=True)
class Record:
    mem_weights_bytes: int
    mem_kv_bytes: int = 0
    compute_speed: float = 100.0
    rtts_ms: tuple = ()
    extras: dict = field(default_factory=dict)
    name: str = ""
    windows_inexact: str = ""
    serving: tuple = ()


@dataclass(frozen=True)
class View:
    record: Record
    state: str = "alive"


class World:
    """Every agent's record, as gossip would converge to it."""

    def __init__(self) -> None:
        self.views: dict[str, View] = {}
        self.generation = 0
        self.changed = trio.Event()

    def bump(self) -> None:
        self.generation += 1
        self.changed.set()
        self.changed = trio.Event()


class FakeGossip:
    def __init__(self, world: World, peer_id: str) -> None:
        self.world = world
        self.peer_id = peer_id

    def snapshot(self) -> dict[str, Any]:
        return dict(self.world.views)

    def update_local(self, **fields: Any) -> None:
        view = self.world.views[self.peer_id]
        self.world.views[self.peer_id] = replace(view, record=replace(view.record, **fields))
        self.world.bump()

    def spread_now(self) -> None:
        pass  # every agent of the world sees an update at once already

    @property
    def generation(self) -> int:
        return self.world.generation

    async def wait_changed(self, after: int) -> int:
        while self.world.generation <= after:
            await self.world.changed.wait()
        return self.world.generation


def agent(world: World, pid: str, gb: float, loads: list, *, load_s: float = 0.5, released=None):
    world.views[pid] = View(Record(int(gb * GB)))

    async def take_part(plan: Plan) -> None:
        loads.append((pid, plan_digest(plan)))
        await trio.sleep(load_s)  # loading a stage takes a while

    async def release(plan: Plan) -> None:
        released.append((pid, trio.current_time()))

    return PlacementService(
        FakeGossip(world, pid),
        MODEL,
        context_tokens=1000,
        take_part=take_part,
        release=release if released is not None else None,
    )


def start_three(world: World, loads: list, nursery: trio.Nursery, **kw) -> list:
    """Agents a, b and c of 1.3 GB each, running (`kw`: as `agent` takes them)."""
    services = [agent(world, p, 1.3, loads, **kw) for p in "abc"]
    for s in services:
        nursery.start_soon(s.run)
    return services


async def three_agreed(world: World, loads: list, nursery: trio.Nursery) -> list:
    """Agents a, b and c, running until they agree on a plan."""
    services = start_three(world, loads, nursery)
    await settle(services)
    return services


async def settle(services, seconds: float = 20.0) -> None:
    await trio.sleep(seconds)
    digests = {plan_digest(s.in_force.plan) for s in services if s.in_force}
    assert len(digests) == 1, digests


async def test_three_agents_agree_on_a_split_then_replan_when_one_dies(autojump_clock):
    world = World()
    loads: list = []
    async with trio.open_nursery() as nursery:
        services = await three_agreed(world, loads, nursery)
        plan = services[0].in_force.plan
        assert plan.split and {st.peer_id for st in plan.stages} == {"a", "b", "c"}
        assert all(s.routable for s in services)
        # Each agent loaded its part of the agreed plan once (proposals that lost a race may
        # have been loaded too, but the final plan exactly once per agent).
        final = [pid for pid, d in loads if d == plan_digest(plan)]
        assert sorted(final) == ["a", "b", "c"]

        # c dies; d, big enough to host the model alone, joins: the mesh replans without
        # restarting a or b, and d serves the model whole.
        world.views["c"] = replace(world.views["c"], state="dead")
        d = agent(world, "d", 8.0, loads)
        services.append(d)
        nursery.start_soon(d.run)
        world.bump()
        live = [s for s in services if s.gossip.peer_id != "c"]
        await settle(live)
        assert live[0].in_force.plan.replicas == ("d",)
        assert all(s.routable for s in live)
        nursery.cancel_scope.cancel()


async def test_no_plan_reports_what_is_missing(autojump_clock):
    world = World()
    services = [agent(world, p, 0.5, []) for p in ("a", "b")]
    for s in services:
        await s.step()
    assert services[0].in_force is None
    assert "GB more memory" in services[0].error


async def test_an_agent_that_cannot_load_its_part_says_why_and_keeps_running(autojump_clock):
    world = World()
    world.views["a"] = View(Record(int(4 * GB)))
    tries = []

    async def take_part(plan: Plan) -> None:
        tries.append(plan_digest(plan))
        raise EngineError("llama.cpp could not create a context")

    service = PlacementService(
        FakeGossip(world, "a"), MODEL, context_tokens=1000, take_part=take_part
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.run)
        await trio.sleep(20)
        assert len(tries) == 1  # the same plan is not retried every round
        assert not service.routable
        assert "could not load this agent's part" in service.error
        assert "could not create a context" in service.error
        nursery.cancel_scope.cancel()


async def test_a_repair_settles_sooner_than_a_new_plan(autojump_clock):
    # The split loses a stage and a spare takes its layers: every agent computes that same
    # repair, so the spare loads after `repair_settle` rather than the full `settle`.
    world = World()
    loads: list = []
    async with trio.open_nursery() as nursery:
        services = await three_agreed(world, loads, nursery)
        before = services[0].in_force.plan
        lost = before.stages[1].peer_id
        spare = agent(world, "s", 1.3, loads)
        nursery.start_soon(spare.run)
        world.bump()
        await trio.sleep(5)
        assert services[0].in_force.plan == before  # a spare alone changes nothing
        world.views[lost] = replace(world.views[lost], state="dead")
        world.bump()
        died = trio.current_time()
        with trio.fail_after(10):
            while not any(pid == "s" for pid, _ in loads):
                await trio.sleep(0.01)
        waited = trio.current_time() - died
        after = services[0].in_force.plan
        assert is_repair(before, after) and "s" in after.peers
        assert waited < services[0].settle <= 2 * waited + 2  # sooner, yet not at once
        assert waited >= services[0].repair_settle
        nursery.cancel_scope.cancel()


async def three_loading(world: World, loads: list, nursery: trio.Nursery, released=None) -> list:
    """Agents a, b and c, once each is loading its part of their split (a load takes a
    minute)."""
    services = start_three(world, loads, nursery, load_s=60.0, released=released)
    with trio.fail_after(10):
        while len(loads) < 3:
            await trio.sleep(0.01)
    return services


def kill(world: World, service: PlacementService) -> None:
    """The agent of `service` dies: it stops, and the others' gossip says it is dead."""
    service.stop()
    pid = service.gossip.peer_id
    world.views[pid] = replace(world.views[pid], state="dead")
    world.bump()


async def test_an_agent_loading_its_part_follows_the_mesh_meanwhile(autojump_clock):
    # Loading a part can take minutes (a download). Meanwhile a peer of the plan dies: every
    # agent, the ones loading included, moves to the new plan at once and says so (status,
    # routing), rather than when its load is over; the load of the plan no longer in force is
    # never claimed ready, and each agent then loads its part of the new plan.
    world = World()
    loads: list = []
    async with trio.open_nursery() as nursery:
        services = await three_loading(world, loads, nursery)
        first = services[0].in_force.plan
        spare = agent(world, "s", 1.3, loads, load_s=60.0)
        nursery.start_soon(spare.run)
        kill(world, services[2])
        await trio.sleep(5)
        for s in services[:2]:
            assert s.in_force.plan != first and "c" not in s.in_force.plan.peers
            assert s.mine.plan == s.in_force.plan and not s.mine.ready and not s.routable
        after = services[0].in_force.plan
        await trio.sleep(200)
        live = [*services[:2], spare]
        assert all(s.routable and s.in_force.plan == after and s.mine.ready for s in live)
        assert sorted(pid for pid, d in loads if d == plan_digest(after)) == ["a", "b", "s"]
        nursery.cancel_scope.cancel()


async def test_a_part_loaded_for_a_plan_replaced_meanwhile_is_released_when_loaded(autojump_clock):
    # a, b and c load their parts of a split (slowly); meanwhile c dies and d, big enough to
    # serve the model alone, joins. a and b agree to the new plan at once (they have no part
    # in it) and release what they were loading as soon as it is loaded, not serving it.
    world = World()
    loads: list = []
    released: list = []
    async with trio.open_nursery() as nursery:
        services = await three_loading(world, loads, nursery, released)
        started = trio.current_time()
        d = agent(world, "d", 8.0, loads, load_s=60.0, released=released)
        nursery.start_soon(d.run)
        kill(world, services[2])
        await trio.sleep(5)
        for s in services[:2]:
            assert s.in_force.plan.replicas == ("d",) and not s.routable
            # outside the plan, only its proposer claims it
            mine = s.gossip.peer_id == s.in_force.proposer
            assert (s.mine is not None and s.mine.ready) if mine else s.mine is None
        assert released == []  # a load in flight is judged when it ends
        await trio.sleep(100)
        assert all(s.routable for s in (*services[:2], d))
        assert sorted(pid for pid, _ in released) == ["a", "b"]
        assert all(60 <= t - started < 61 for _, t in released)
        nursery.cancel_scope.cancel()


def test_a_repair_is_the_same_layers_on_other_peers():
    one = Plan("m", 10, stages=(StageAssignment("a", 0, 5), StageAssignment("b", 5, 9)))
    swapped = Plan("m", 10, stages=(StageAssignment("a", 0, 5), StageAssignment("s", 5, 9)))
    moved = Plan("m", 10, stages=(StageAssignment("a", 0, 4), StageAssignment("s", 4, 9)))
    assert is_repair(one, swapped)
    assert not is_repair(one, one) and not is_repair(one, moved)
    assert not is_repair(one, Plan("m", 10, replicas=("a",)))


def test_capacities_say_what_each_peer_holds_of_the_model_file():
    from types import SimpleNamespace

    from meshagent.gossip.failure import PeerState
    from meshagent.gossip.peer_record import ArtifactHeld, ModelHeld, PeerRecord
    from meshagent.placement.service import capacities

    sha, other = "a" * 64, "b" * 64

    def held(source: str, start: int, end: int, kind: str = "layers") -> ArtifactHeld:
        return ArtifactHeld("k", "c" * 64, kind, source, "m.gguf", start, end, 30, 1, 1, 1)

    def view(pid: str, **fields) -> SimpleNamespace:
        record = PeerRecord(
            pid, b"", 1, mem_weights_bytes=10**9, mem_kv_bytes=10**8, compute_speed=5.0, **fields
        )
        return SimpleNamespace(state=PeerState.ALIVE, record=record)

    views = {
        "file": view("file", models=(ModelHeld("m", sha, "llama", 30, 10),)),
        "part": view("part", artifacts=(held(sha, 0, 10), held(sha, 0, 0, "entry"))),
        "else": view("else", artifacts=(held(other, 10, 20),)),
    }
    caps = {c.peer_id: c for c in capacities(views, source_sha256=sha)}
    assert caps["file"].whole_file and not caps["part"].whole_file
    assert caps["part"].holds == {(0, 10)} and caps["else"].holds == frozenset()
    # The model file's hash not known yet: every peer counts as holding it (no preference).
    assert all(c.whole_file for c in capacities(views))


def test_a_model_is_planned_only_on_the_peers_that_take_part_in_it():
    from types import SimpleNamespace

    from meshagent.gossip.failure import PeerState
    from meshagent.gossip.peer_record import PeerRecord
    from meshagent.placement.service import TAKES_KEY, capacities

    def view(pid: str, **extras) -> SimpleNamespace:
        record = PeerRecord(
            pid, b"", 1, mem_weights_bytes=10**9, mem_kv_bytes=10**8, compute_speed=5.0
        )
        return SimpleNamespace(
            state=PeerState.ALIVE, record=replace(record, extras=extras) if extras else record
        )

    views = {
        "coder": view("coder", **{TAKES_KEY: ["Coder-1.5B", "SmolLM2"]}),
        "chat": view("chat", **{TAKES_KEY: ["smollm2"]}),  # ids match whatever their case
        "old": view("old"),  # says nothing: an agent before many models takes part in all
        "bad": view("bad", **{TAKES_KEY: "SmolLM2"}),  # not a list: none
        "huge": view("huge", **{TAKES_KEY: ["SmolLM2"] * 65}),  # past the bound: none
    }

    def planned(model_id: str) -> set[str]:
        return {c.peer_id for c in capacities(views, model_id=model_id)}

    assert planned("SmolLM2") == {"coder", "chat", "old"}
    assert planned("Coder-1.5B") == {"coder", "old"}
    assert planned("Other") == {"old"}
    assert len(capacities(views)) == 5  # no model named: every peer


async def test_a_model_the_assignment_places_nowhere_is_stood_down_and_placed_again(
    autojump_clock,
):
    from meshagent.placement.service import EXTRAS_KEY

    world = World()
    loads: list = []
    released: list = []
    placed = [True]

    def allowance(caps):
        return caps if placed[0] else "idle for 5m (keep_alive): unloaded"

    async with trio.open_nursery() as nursery:
        services = start_three(world, loads, nursery, released=released)
        for s in services:
            s.allowance = allowance
        await settle(services)
        assert all(s.routable for s in services)

        placed[0] = False  # e.g. no request within keep_alive
        world.bump()
        await trio.sleep(5)
        assert not any(s.routable or s.placed or s.in_force for s in services)
        assert {s.error for s in services} == {"idle for 5m (keep_alive): unloaded"}
        assert sorted(pid for pid, _ in released) == ["a", "b", "c"]  # every part let go
        assert all(
            MODEL.model_id not in v.record.extras.get(EXTRAS_KEY, {}) for v in world.views.values()
        )

        loads.clear()
        placed[0] = True  # asked for again
        world.bump()
        await settle(services)
        assert all(s.routable and s.placed for s in services)
        digest = plan_digest(services[0].in_force.plan)
        assert sorted(pid for pid, d in loads if d == digest) == ["a", "b", "c"]
        nursery.cancel_scope.cancel()


async def test_an_agent_that_finds_no_plan_of_its_own_follows_the_plan_in_force(autojump_clock):
    # a's view of the offers (here: only itself) holds no plan; b's and c's hold a split over
    # all three. a loads its part of their plan and reports no error meanwhile: a request
    # waiting on a for the model waits for the load instead of failing with a's view.
    world = World()
    loads: list = []
    async with trio.open_nursery() as nursery:
        services = start_three(world, loads, nursery, load_s=5.0)
        a = services[0]
        a.allowance = lambda caps: [c for c in caps if c.peer_id == "a"]
        world.bump()
        await trio.sleep(4)  # the plan is in force; its parts are loading
        assert a.in_force is not None and not a.routable
        assert set(a.in_force.plan.peers) == {"a", "b", "c"}
        assert a.error is None
        await settle(services)
        assert all(s.routable for s in services) and a.error is None
        nursery.cancel_scope.cancel()


class CutOffGossip(FakeGossip):
    """The world as an agent on the small side of a cut sees it: the agents across it look
    dead from `cut_at`."""

    def __init__(self, world: World, peer_id: str, side: set[str]) -> None:
        super().__init__(world, peer_id)
        self.side = side
        self.cut_at: float | None = None

    def snapshot(self) -> dict[str, Any]:
        views = dict(self.world.views)
        if self.cut_at is not None:
            for pid in views:
                if pid not in self.side:
                    views[pid] = replace(views[pid], state="dead")
        return views


async def test_the_small_side_of_a_cut_proposes_no_plan_until_the_quorum_window_passes(
    autojump_clock,
):
    # a, b and c serve a split; d and e, big enough to serve it between them, are spares.
    # Cut off, d and e see three agents dead and two alive: they propose nothing (were they
    # to plan on their own, their plan's higher epoch would win over the one a, b and c
    # serve when the cut heals) and say why. Once the window has passed, they plan again.
    world = World()
    loads: list = []
    async with trio.open_nursery() as nursery:
        services = await three_agreed(world, loads, nursery)
        first = services[0].in_force.plan
        small = []
        for pid in "de":
            s = agent(world, pid, 2.0, loads)
            s.gossip = CutOffGossip(world, pid, {"d", "e"})
            small.append(s)
            nursery.start_soon(s.run)
        await trio.sleep(10)
        assert all(s.in_force.plan == first for s in small)  # they follow it, as spares
        for s in small:
            s.gossip.cut_at = trio.current_time()
        world.bump()
        await trio.sleep(30)
        for s in small:
            assert s.in_force is None or s.in_force.plan == first
            assert s.error is not None and "sees 2 agents where 5 were alive" in s.error
        assert all(s.in_force.plan == first and s.routable for s in services)
        await trio.sleep(40)  # past the window: the small side plans on its own
        plans = {plan_digest(s.in_force.plan) for s in small if s.in_force is not None}
        assert len(plans) == 1 and set(small[0].in_force.plan.peers) == {"d", "e"}
        nursery.cancel_scope.cancel()
