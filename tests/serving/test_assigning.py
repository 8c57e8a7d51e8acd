"""An agent following the catalogue and the mesh's assignment (`serving/assigning.py`), over
fakes of the catalogue, gossip and the model host: demand loads and unloads a model, pins keep
it, a removal drops it, a new entry is taken part in, and an empty mesh is seeded."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import trio

from meshagent.gossip.failure import PeerState
from meshagent.gossip.peer_record import PeerRecord
from meshagent.placement.demand import EXTRAS_KEY as DEMAND_KEY
from meshagent.placement.demand import from_cbor
from meshagent.placement.planner import ModelCost
from meshagent.placement.service import TAKES_KEY
from meshagent.serving import assigning as assigning_module
from meshagent.serving.assigning import PINS_KEY, Assigning

GB = 1_000_000_000
NOW = 1_800_000_000.0


def _cost(name: str, gb: float = 1.0, layers: int = 10) -> ModelCost:
    return ModelCost(name, layers, (int(gb * GB) // layers,) * layers, 0, 0, 0, 0)


@dataclass
class Entry:
    name: str
    sha256: str = "a" * 64
    is_add: bool = True

    def cost(self) -> ModelCost:
        return _cost(self.name)


class Catalog:
    def __init__(self, *names: str) -> None:
        self.live = {n: Entry(n) for n in names}
        self.removed: set[str] = set()
        self.generation = 0
        self.changed = trio.Event()
        self.added: list[str] = []
        self.book = SimpleNamespace(winner=self._winner)

    def _winner(self, name: str) -> Any:
        if name in self.removed:
            return SimpleNamespace(entry=Entry(name, is_add=False))
        return SimpleNamespace(entry=self.live[name]) if name in self.live else None

    def entries(self) -> dict[str, Entry]:
        return dict(self.live)

    def bump(self) -> None:
        self.generation += 1
        self.changed.set()
        self.changed = trio.Event()

    async def wait_changed(self, after: int) -> int:
        while self.generation <= after:
            await self.changed.wait()
        return self.generation

    async def add(self, spec: str) -> Any:
        self.added.append(spec)
        self.live["default"] = Entry("default")
        self.bump()
        return SimpleNamespace(entry=self.live["default"])


class Gossip:
    """The mesh's records as every agent would see them once gossip converged."""

    def __init__(self, peer_id: str, **peers: dict) -> None:
        self.peer_id = peer_id
        self.views: dict[str, Any] = {}
        for pid, extras in {peer_id: {}, **peers}.items():
            record = PeerRecord(pid, b"", 1, mem_weights_bytes=4 * GB, compute_speed=100.0)
            self.views[pid] = SimpleNamespace(
                state=PeerState.ALIVE, record=replace(record, extras=extras)
            )
        self.generation = 0
        self.changed = trio.Event()

    def snapshot(self) -> dict[str, Any]:
        return dict(self.views)

    def update_local(self, **fields: Any) -> None:
        view = self.views[self.peer_id]
        self.views[self.peer_id] = SimpleNamespace(
            state=view.state, record=replace(view.record, **fields)
        )
        self.generation += 1
        self.changed.set()
        self.changed = trio.Event()

    def spread_now(self) -> None:
        pass

    async def wait_changed(self, after: int) -> int:
        while self.generation <= after:
            await self.changed.wait()
        return self.generation


@dataclass
class Host:
    models: dict[str, Any] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    def __iter__(self):
        return iter(list(self.models.values()))

    def get(self, name: str) -> Any:
        return self.models.get(name)

    def add(self, model: Any) -> None:
        self.models[model.info.id] = model

    async def remove(self, name: str) -> None:
        self.removed.append(name)
        self.models.pop(name, None)


def _model(name: str) -> Any:
    placement = SimpleNamespace(
        allowance=None, cost=_cost(name), in_force=None, routable=False, ready=()
    )
    source = SimpleNamespace(downloads=lambda: [])
    return SimpleNamespace(info=SimpleNamespace(id=name), placement=placement, source=source)


async def _inline(compute: Any) -> Any:
    return compute()


def _assigning(host: Host, catalog: Catalog, gossip: Gossip, clock: list[float], **kw) -> Assigning:
    async def obtain(entry: Entry) -> Any:
        return _model(entry.name) if entry.name != "elsewhere" else None

    # The assignment on the event loop: the virtual clock would jump while a thread computes.
    kw.setdefault("off_loop", _inline)
    return Assigning(
        host,
        catalog,
        gossip,
        obtain=obtain,
        context_tokens=1000,
        headroom=0.1,
        keep_alive=300.0,
        seed_after=0.0,
        clock=lambda: clock[0],
        **kw,
    )


def _allowed(model: Any, gossip: Gossip) -> Any:
    """What the model's placement is allowed now: its capacities, or why not."""
    from meshagent.placement.service import capacities

    return model.placement.allowance(capacities(gossip.snapshot(), model_id=model.info.id))


async def test_a_request_places_its_model_and_keep_alive_0_lets_it_go(autojump_clock):
    clock = [NOW]
    host, catalog = Host(), Catalog("chat")
    gossip = Gossip("a")
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    assigning = _assigning(host, catalog, gossip, clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        chat = host.get("chat")  # taken part in: this agent has its file
        assert chat is not None
        assert "not requested" in _allowed(chat, gossip)  # nobody asked: not placed

        assigning.begin("chat")
        await trio.sleep(0.1)
        [share] = _allowed(chat, gossip)  # placed: its share of this agent
        assert share.peer_id == "a" and 0 < share.memory_bytes <= 4 * GB
        [(name, demand)] = from_cbor(gossip.views["a"].record.extras[DEMAND_KEY]).items()
        assert (name, demand.in_flight) == ("chat", 1)  # the mesh hears of it

        clock[0] += 2
        assigning.end("chat", tokens=40, keep_alive=0)
        await trio.sleep(0.1)
        assert "keep_alive 0" in _allowed(chat, gossip)
        assert assigning.summary()[0]["placed"] is False
        nursery.cancel_scope.cancel()


async def test_the_assignment_runs_on_a_worker_thread(monkeypatch):
    host, catalog = Host(), Catalog("chat")
    gossip = Gossip("a")
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    ran_on: list[int] = []

    def assign(*args: Any, **kw: Any) -> Any:
        ran_on.append(threading.get_ident())
        return real_assign(*args, **kw)

    real_assign = assigning_module.assign
    monkeypatch.setattr(assigning_module, "assign", assign)

    async def obtain(entry: Entry) -> Any:
        return _model(entry.name)

    assigning = Assigning(host, catalog, gossip, obtain=obtain, context_tokens=1000,
                          headroom=0.1, keep_alive=300.0, seed_after=0.0)  # fmt: skip
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        assigning.begin("chat")
        with trio.fail_after(10):
            while (chat := host.get("chat")) is None or isinstance(_allowed(chat, gossip), str):
                await trio.sleep(0.01)
        assert ran_on and threading.get_ident() not in ran_on
        nursery.cancel_scope.cancel()


async def test_a_change_while_the_assignment_computes_is_assigned_again_at_once(autojump_clock):
    """The assignment runs on a worker thread: a record that arrives meanwhile is not in it,
    and the loop assigns again at once rather than at the next tick."""
    clock = [NOW]
    host, catalog = Host(), Catalog("chat")
    gossip = Gossip("a")
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    arrive = []

    async def off_loop(compute: Any) -> Any:
        result = compute()
        if arrive:  # b's record, pinning chat, comes in while this one computes
            arrive.pop()
            record = PeerRecord("b", b"", 1, mem_weights_bytes=4 * GB, compute_speed=100.0)
            extras = {PINS_KEY: ["chat"], TAKES_KEY: ["chat"]}
            gossip.views["b"] = SimpleNamespace(
                state=PeerState.ALIVE, record=replace(record, extras=extras)
            )
            gossip.generation += 1
            gossip.changed.set()
            gossip.changed = trio.Event()
        return result

    assigning = _assigning(host, catalog, gossip, clock, off_loop=off_loop)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        assert "not pinned" in _allowed(host.get("chat"), gossip)
        arrive.append(True)
        gossip.update_local(mem_kv_bytes=1)  # some change: the next assignment runs
        start = trio.current_time()
        with trio.fail_after(60):
            while isinstance(_allowed(host.get("chat"), gossip), str):
                await trio.sleep(0.01)
        assert not arrive
        assert trio.current_time() - start < 1.0  # not the next tick's (30 s)
        nursery.cancel_scope.cancel()


async def test_a_pin_gossiped_by_any_agent_keeps_a_model_placed(autojump_clock):
    clock = [NOW]
    host, catalog = Host(), Catalog("chat", "code")
    gossip = Gossip("a", b={PINS_KEY: ["CODE"], TAKES_KEY: ["code"]})
    gossip.update_local(extras={TAKES_KEY: ["chat", "code"]})
    assigning = _assigning(host, catalog, gossip, clock, pins=("chat",))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        assert isinstance(_allowed(host.get("chat"), gossip), list)  # pinned here
        assert isinstance(_allowed(host.get("code"), gossip), list)  # pinned by b
        summary = {m["model"]: m for m in assigning.summary()}
        assert summary["chat"]["pinned"] and summary["code"]["pinned"]
        assert summary["code"]["unloads_in_s"] is None  # never
        assert gossip.views["a"].record.extras[PINS_KEY] == ["chat"]
        nursery.cancel_scope.cancel()


async def test_the_catalogue_is_followed_removed_models_dropped_others_taken_part_in(
    autojump_clock,
):
    clock = [NOW]
    host, catalog = Host(), Catalog("chat", "elsewhere")
    host.add(_model("old"))  # a model this agent runs that the catalogue then removes
    host.add(_model("started"))  # one it was started with, not catalogued yet
    catalog.removed.add("old")
    gossip = Gossip("a")
    assigning = _assigning(host, catalog, gossip, clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        assert host.removed == ["old"]
        assert set(host.models) == {"chat", "started"}  # "elsewhere": no file here
        assert "catalogue" in _allowed(host.get("started"), gossip)
        catalog.live["code"] = Entry("code")
        catalog.bump()
        await trio.sleep(0.1)
        assert "code" in host.models
        nursery.cancel_scope.cancel()


async def test_an_agent_without_models_seeds_an_empty_mesh_with_the_default(autojump_clock):
    clock = [NOW]
    host, catalog = Host(), Catalog()
    gossip = Gossip("a")
    assigning = _assigning(host, catalog, gossip, clock, seed_default=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        assert catalog.added == [""]  # the embedded default
        assert "default" in assigning.pins and "default" in host.models
        nursery.cancel_scope.cancel()


async def test_pins_a_peer_gossips_out_of_shape_are_left_out(autojump_clock):
    clock = [NOW]
    host, catalog = Host(), Catalog("chat")
    bad = {
        "b": {PINS_KEY: "chat", TAKES_KEY: ["chat"]},  # not a list
        "c": {PINS_KEY: [1, None, {"x": 1}, "nope"], TAKES_KEY: ["chat"]},  # not model names
        "d": {PINS_KEY: ["x"] * 1000 + ["chat"], TAKES_KEY: ["chat"]},  # past the 32 read
    }
    gossip = Gossip("a", **bad)
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    assigning = _assigning(host, catalog, gossip, clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        assert "not requested" in _allowed(host.get("chat"), gossip)  # pinned by no one
        assert not assigning.summary()[0]["pinned"]
        nursery.cancel_scope.cancel()


async def test_a_keep_alive_that_runs_out_between_ticks_unloads_on_time(autojump_clock):
    host, catalog = Host(), Catalog("chat")
    gossip = Gossip("a")
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    assigning = _assigning(host, catalog, gossip, [NOW])
    assigning._clock = lambda: NOW + trio.current_time()  # the clock trio's time moves
    async with trio.open_nursery() as nursery:
        nursery.start_soon(assigning.run)
        await trio.sleep(2)
        chat = host.get("chat")
        assigning.begin("chat")
        await trio.sleep(0.1)
        assigning.end("chat", tokens=40, keep_alive=2.5)
        await trio.sleep(2.3)
        assert isinstance(_allowed(chat, gossip), list)  # still wanted
        await trio.sleep(0.3)  # past its keep_alive, well before the next tick
        assert isinstance(_allowed(chat, gossip), str)
        nursery.cancel_scope.cancel()


def test_a_crowded_model_or_one_peers_still_take_up_keeps_its_requests_waiting():
    from meshagent.placement.assignment import Assignment

    clock = [NOW]
    gossip = Gossip("a", b={TAKES_KEY: []})
    gossip.update_local(extras={TAKES_KEY: ["chat"]})
    assigning = _assigning(Host(), Catalog("chat"), gossip, clock)
    assigning._seen_at["chat"] = NOW  # catalogued now: b may be hashing its file
    assert assigning.may_yet_place("CHAT")
    clock[0] += 61  # b had time enough: it does not take part
    assert not assigning.may_yet_place("chat")
    why = "no memory anywhere: needs 2.0 GB on one peer, the largest free offer is 0.5 GB"
    assigning.assignment = Assignment(not_placed=(("chat", why),))
    assert assigning.why_not_placed("CHAT") == why  # a request fails with it
    assigning.assignment = Assignment(not_placed=(("chat", why),), crowded=("chat",))
    assert assigning.may_yet_place("chat")  # it waits for memory to free
    assigning.assignment = Assignment(not_placed=(("chat", why),))
    clock[0] = NOW + 1
    b = gossip.views["b"]
    gossip.views["b"] = SimpleNamespace(
        state=b.state, record=replace(b.record, extras={TAKES_KEY: ["chat"]})
    )
    assert not assigning.may_yet_place("chat")  # every peer takes part: nothing to wait for


def test_the_summary_says_what_a_placed_model_still_loads():
    from meshagent.placement.assignment import Assignment, Placed
    from meshagent.placement.planner import PeerCapacity, Plan

    host = Host()
    model = _model("chat")
    plan = Plan("chat", 1000, replicas=("a", "bbbbbbbbbbbbbbbbbbbb"))
    model.placement.routable, model.placement.ready = False, ("a",)
    model.placement.in_force = SimpleNamespace(plan=plan)
    fetch = {
        "key": "0123abcd-layers-0-15",
        "source": "peer b",
        "done_bytes": 42,
        "total_bytes": 100,
    }
    model.source = SimpleNamespace(downloads=lambda: [fetch])
    host.add(model)
    assigning = _assigning(host, Catalog("chat"), Gossip("a"), [NOW])
    assigning.assignment = Assignment(
        placed=(Placed("chat", (PeerCapacity("a", GB, 1.0),), plan, 1.0),)
    )
    [m] = assigning.summary()
    assert m["loading"] == (
        "42% of 0123abcd-layers-0-15 from peer b; waiting for bbbbbbbbbbbb to load"
    )
    model.placement.routable = True
    assert assigning.summary()[0]["loading"] is None
