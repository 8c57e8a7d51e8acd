"""Many models on one mesh: this agent follows the catalogue and the mesh's assignment.

- **The catalogue** (`catalog/`): this agent takes part in each catalogued model whose file it
  has or can have (`obtain`), and in none the catalogue removed.
- **Demand**: the requests this agent's API takes, metered per model (`DemandMeter`) and
  gossiped (`placement/demand.py`), with the models this agent pins (`--pin`, and those it
  was started with).
- **The assignment** (`placement/assignment.py`): every agent computes it alike from the
  catalogue, the peers' offers and the mesh's demand; each model's placement then plans
  within its share (`PlacementService.allowance`), or stands down where the model is not
  placed (no demand within keep_alive, or its memory went to a more demanded model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol

import structlog
import trio

from meshagent.catalog.entry import CatalogEntry
from meshagent.errors import MeshError
from meshagent.gossip.failure import PeerState
from meshagent.placement import demand as demands
from meshagent.placement.assignment import Assignment, assign, restrict
from meshagent.placement.costs import MAX_CHAINS
from meshagent.placement.demand import DemandMeter
from meshagent.placement.negotiation import plan_in_force
from meshagent.placement.planner import ModelCost, PeerCapacity, Plan
from meshagent.placement.service import Snapshot, capacities, claims_for, takes_part
from meshagent.serving.mesh_model import MeshModel
from meshagent.serving.model_host import ModelHost
from meshagent.waiting import first
from meshagent.wording import peer_label

log = structlog.get_logger(__name__)

PINS_KEY = "pins"  # the models an agent pins, in the `extras` of its record
MAX_PINS = 32
CHAINS_KEY = "chains"  # the chains it asks of a split it pins (`--chains`), when more than 1
# Seconds between assignments when nothing changes: demand ages with the clock alone (in
# buckets of a minute, `demand.BUCKET_S`), and any request or gossiped change recomputes it
# at once. A keep_alive that runs out wakes the loop at once.
TICK = 30.0
# Seconds a new agent listens for its mesh's catalogue before it seeds an empty one with the
# embedded default.
SEED_AFTER = 3.0
# Seconds after a model is catalogued during which peers may still be taking it up (hashing
# its file): a request for it waits for them rather than fail on the mesh as it looks.
TAKE_UP = 60.0
NOT_CATALOGUED = "not in the mesh's catalogue (meshagent models add)"


class CatalogView(Protocol):
    """What the assignment reads of the catalogue (`catalog.service.Catalog` fits)."""

    def entries(self) -> dict[str, CatalogEntry]: ...

    @property
    def generation(self) -> int: ...

    async def wait_changed(self, after: int) -> int: ...

    async def add(self, spec: str) -> Any: ...


Obtain = Callable[[CatalogEntry], Awaitable[MeshModel | None]]


class Assigning:
    def __init__(
        self,
        host: ModelHost,
        catalog: CatalogView,
        gossip: Snapshot,
        *,
        obtain: Obtain,
        context_tokens: int,
        headroom: float,
        keep_alive: float,
        pins: tuple[str, ...] = (),
        chains: int = 1,
        streams: int = 1,
        seed_default: bool = False,
        seed_after: float = SEED_AFTER,
        load_timeout: float = 600.0,
        clock: Callable[[], float] = time.time,
        off_loop: Callable[[Callable[[], Assignment]], Awaitable[Assignment]] = (
            trio.to_thread.run_sync
        ),
    ) -> None:
        self.host = host
        self.catalog = catalog
        self.gossip = gossip
        self._obtain = obtain  # this agent's MeshModel of an entry, or None: cannot have it
        self.context_tokens = context_tokens
        self.headroom = headroom
        self.meter = DemandMeter(default_keep_alive=keep_alive)
        self.pins = tuple(pins)
        self.chains = chains
        self.streams = streams  # sequences a replica or chain decodes together (`--slots`)
        self._seed_default = seed_default  # pin the embedded default if the mesh has none
        self._seed_after = seed_after  # seconds to listen for the mesh's catalogue first
        self.load_timeout = load_timeout  # seconds a request waits for its model to load
        self._clock = clock
        self._off_loop = off_loop  # runs the assignment off the event loop (`reassign`)
        self.assignment = Assignment()
        self._heard_catalogue = False  # past the start: a model not catalogued is not placed
        self._cannot: dict[tuple[str, str], str] = {}  # (name, sha256) -> why not here
        self._obtaining: set[str] = set()
        self._seen_at: dict[str, float] = {}  # when each catalogued model was first seen
        self._poke = trio.Event()  # set when local demand changes
        self._published: tuple[Any, Any] | None = None
        self._nursery: trio.Nursery | None = None

    # ----- what the API meters (`api/catalog.py`'s `DemandSink`) -----

    def begin(self, model_id: str) -> None:
        """A request for `model_id` begins: the model is wanted while it runs."""
        self.meter.begin(model_id, now=self._clock())
        self._poke.set()

    def end(self, model_id: str, tokens: int, keep_alive: float | None = None) -> None:
        """A request for `model_id` ended having cost `tokens` (decoded ones, its prompt at
        `costs.PREFILL_SHARE` each: `RequestMeter.work`); its `keep_alive` (seconds;
        None: the agent's) says how long the model stays wanted."""
        self.meter.end(model_id, now=self._clock(), tokens=tokens, keep_alive=keep_alive)
        self._poke.set()

    def catalogued(self, name: str) -> bool:
        return any(n.casefold() == name.casefold() for n in self.catalog.entries())

    def expires_at(self, name: str) -> float | None:
        """When `name` unloads: never where pinned, else when the mesh's keep_alive for it
        runs out (unix time; None: no demand known)."""
        if name.casefold() in {p.casefold() for p in self._pins(self.gossip.snapshot())}:
            return math.inf
        now = self._clock()
        for model_id, d in self._demand(self.gossip.snapshot(), now).items():
            if model_id.casefold() == name.casefold():
                return math.inf if d.in_flight else d.expires_at
        return None

    def summary(self) -> list[dict[str, Any]]:
        """Each catalogued model as the mesh assigns it now, for the agent's status: where
        it is placed (or why not), its demand, when it unloads, whether it is pinned and
        whether this agent takes part in it."""
        now = self._clock()
        views = self.gossip.snapshot()
        demand = {m.casefold(): d for m, d in self._demand(views, now).items()}
        pins = {p.casefold() for p in self._pins(views)}
        out = []
        for name in self.catalog.entries():
            placed = self.assignment.get(name)
            d = demand.get(name.casefold(), demands.Demand())
            ends = self.expires_at(name)
            out.append(
                {
                    "model": name,
                    "placed": placed is not None,
                    "peers": list(placed.peer_ids) if placed else [],
                    "why_not": None if placed else self.assignment.reason(name),
                    "loading": self._loading(name) if placed else None,
                    "pinned": name.casefold() in pins,
                    "here": self.host.get(name) is not None,
                    "in_flight": d.in_flight,
                    "tokens_per_s": round(d.tokens_per_s(now), 3),
                    "requests_per_min": round(60 * d.requests_per_s(now), 3),
                    "unloads_in_s": None
                    if ends is None or math.isinf(ends)
                    else round(max(0.0, ends - now), 1),
                }
            )
        return out

    def _loading(self, name: str) -> str | None:
        """While `name` is placed and not served yet: what this agent downloads for it (how
        much of which artifact, from where) and which peers still load their part."""
        model = self.host.get(name)
        if model is None or model.placement.in_force is None or model.placement.routable:
            return None
        placement, in_force = model.placement, model.placement.in_force
        said = []
        for f in model.source.downloads():
            done = f"{100 * f['done_bytes'] // f['total_bytes']}%" if f["total_bytes"] else "0%"
            said.append(f"{done} of {f['key']} from {f['source']}")
        views = self.gossip.snapshot()
        names = {p: v.record.name for p, v in views.items() if v.record is not None}
        waiting = [peer_label(p, names) for p in in_force.plan.peers if p not in placement.ready]
        if waiting:
            said.append(f"waiting for {', '.join(waiting)} to load")
        return "; ".join(said) or "loading"

    def why_not_placed(self, name: str) -> str | None:
        return next(
            (why for m, why in self.assignment.not_placed if m.casefold() == name.casefold()),
            None,
        )

    def may_yet_place(self, name: str) -> bool:
        """A crowded model (`Assignment.crowded`: models in use hold its memory until they go
        idle), or one still being taken up: this agent is obtaining it, or it was catalogued
        under `TAKE_UP` ago and some alive peer does not take part in it yet (a peer hashes
        the file first; till then the mesh looks smaller than it is)."""
        key = name.casefold()
        if any(m.casefold() == key for m in self.assignment.crowded) or key in self._obtaining:
            return True
        seen = self._seen_at.get(key)
        if seen is None or self._clock() - seen >= TAKE_UP:
            return False
        entry = next((n for n in self.catalog.entries() if n.casefold() == key), name)
        views = self.gossip.snapshot()
        return any(
            v.state != PeerState.DEAD and not takes_part(v.record, entry) for v in views.values()
        )

    # ----- the loop -----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._seed()
            self._heard_catalogue = True
            while True:
                self._poke = trio.Event()
                self._follow()
                before = self.gossip.generation, self.catalog.generation
                await self.reassign()
                # The assignment ran on a worker thread: what changed meanwhile is not in it.
                moved = (self.gossip.generation, self.catalog.generation) != before
                self._publish()
                if moved:
                    continue
                # Read after publishing (nothing else runs in between): this agent's own new
                # record is not a change to wake for.
                seen, cat = self.gossip.generation, self.catalog.generation
                with trio.move_on_after(self._next_wake()):
                    await first(
                        partial(self.gossip.wait_changed, seen),
                        partial(self.catalog.wait_changed, cat),
                        self._poke.wait,
                    )

    def _next_wake(self) -> float:
        """Seconds until the assignment is due with no change: `TICK`, or sooner where a
        model's keep_alive runs out."""
        now = self._clock()
        ends = [
            d.expires_at
            for d in self._demand(self.gossip.snapshot(), now).values()
            if not d.in_flight and now < d.expires_at < now + TICK
        ]
        return max(0.01, min(ends, default=now + TICK) - now + 0.01)

    async def _seed(self) -> None:
        """An agent started without a model: once it has listened for the mesh's catalogue,
        an empty one gets the embedded default, which this agent then pins (a fresh mesh
        serves it at once, as one agent alone always has)."""
        if not self._seed_default:
            return
        with trio.move_on_after(self._seed_after):
            while not self.catalog.entries():
                await self.catalog.wait_changed(self.catalog.generation)
        if self.catalog.entries():
            return
        try:
            signed = await self.catalog.add("")
        except MeshError as e:
            log.warning("assigning.seed_failed", error=str(e))
            return
        self.pins = (*self.pins, signed.entry.name)
        log.info("assigning.seeded", model=signed.entry.name)

    def _follow(self) -> None:
        """Take part in each catalogued model this agent can have; none that was removed."""
        live = self.catalog.entries()
        for name in live:
            self._seen_at.setdefault(name.casefold(), self._clock())
        for name, entry in live.items():
            if self.host.get(name) is not None or name.casefold() in self._obtaining:
                continue
            if (name.casefold(), entry.sha256) in self._cannot:
                continue
            assert self._nursery is not None
            self._obtaining.add(name.casefold())
            self._nursery.start_soon(self._take_part, entry)
        keys = {n.casefold() for n in live}
        for model in self.host:
            if model.info.id.casefold() not in keys and self._removed(model.info.id):
                assert self._nursery is not None
                self._nursery.start_soon(self.host.remove, model.info.id)

    def _removed(self, name: str) -> bool:
        """The catalogue holds a removal of `name` (not merely no entry yet)."""
        book = getattr(self.catalog, "book", None)
        held = book.winner(name) if book is not None else None
        return held is not None and not held.entry.is_add

    async def _take_part(self, entry: CatalogEntry) -> None:
        try:
            model = await self._obtain(entry)
        except MeshError as e:
            model, why = None, str(e)
        else:
            why = "this agent cannot have its file"
        finally:
            self._obtaining.discard(entry.name.casefold())
        if model is None:
            self._cannot[(entry.name.casefold(), entry.sha256)] = why
            log.info("assigning.no_part", model=entry.name, why=why)
            return
        if self.host.get(entry.name) is None:
            self.host.add(model)
            log.info("assigning.takes_part", model=entry.name)
            self._poke.set()

    # ----- the assignment -----

    async def reassign(self) -> Assignment:
        """The assignment on what this agent knows now; each model's placement is told its
        share. `assign` runs on a worker thread over a snapshot of the inputs (it is pure):
        at hundreds of agents a new chain's search takes seconds, which the event loop (the
        probes, the streams) must not wait out."""
        entries = self.catalog.entries()
        self.assignment = await self._off_loop(self._assignment_of(entries))
        for model in self.host:
            model.placement.allowance = self._allowance(model.info.id, entries)
            placed = self.assignment.get(model.info.id)
            model.placement.chains = placed.chains if placed is not None else 1
        return self.assignment

    def _assignment_of(self, entries: Mapping[str, CatalogEntry]) -> Callable[[], Assignment]:
        """The assignment on what this agent knows now, to compute: its inputs read here."""
        now = self._clock()
        views = self.gossip.snapshot()
        models = {name: self._cost(name, e) for name, e in entries.items()}
        peers = capacities(views)
        eligible = {
            name: frozenset(
                pid
                for pid, v in views.items()
                if v.state != PeerState.DEAD and takes_part(v.record, name)
            )
            for name in models
        }
        return partial(
            assign,
            models,
            peers,
            self._demand(views, now),
            now=now,
            context_tokens=self.context_tokens,
            headroom=self.headroom,
            pins=self._pins(views),
            current=_plans_in_force(views, models),
            eligible=eligible,
            chains=self._chains(views),
            streams=self.streams,
        )

    def _cost(self, name: str, entry: CatalogEntry) -> ModelCost:
        """What the model costs to host: as this agent's placement of it knows it where it
        takes part (a family split only once certified may split once a capability record
        says so, `MeshModel._watch_certification`), else as its catalogue entry says."""
        model = self.host.get(name)
        return model.placement.cost if model is not None else entry.cost()

    def _allowance(
        self, model_id: str, entries: Mapping[str, CatalogEntry]
    ) -> Callable[[list[PeerCapacity]], list[PeerCapacity] | str] | None:
        if not any(n.casefold() == model_id.casefold() for n in entries):
            if not self._heard_catalogue:
                return None  # (while starting: as before the catalogue)
            return lambda caps: NOT_CATALOGUED
        placed = self.assignment.get(model_id)
        if placed is None:
            why = self.assignment.reason(model_id) or "not placed"
            return lambda caps: why
        return lambda caps: restrict(placed, caps)

    def _demand(self, views: Mapping[str, Any], now: float) -> dict[str, demands.Demand]:
        """The mesh's demand: what peers gossip, and this agent's own as it is now."""
        me = self.gossip.peer_id
        others = demands.gossiped({pid: v for pid, v in views.items() if pid != me})
        return demands.merge([others, self.meter.demand(now=now)])

    def _pins(self, views: Mapping[str, Any]) -> frozenset[str]:
        """The models any alive agent pins (case as the catalogue has them)."""
        names = {n.casefold(): n for n in self.catalog.entries()}
        out = {names[p.casefold()] for p in self.pins if p.casefold() in names}
        for pid, v in views.items():
            if v.state == PeerState.DEAD or pid == self.gossip.peer_id:
                continue
            pins = v.record.extras.get(PINS_KEY)
            if isinstance(pins, list):
                for p in pins[:MAX_PINS]:
                    if isinstance(p, str) and p.casefold() in names:
                        out.add(names[p.casefold()])
        return frozenset(out)

    def _chains(self, views: Mapping[str, Any]) -> dict[str, int]:
        """The chains asked of each model that agents pin: the most any alive agent pinning
        it asks for (`--chains`), within `MAX_CHAINS`."""
        names = {n.casefold(): n for n in self.catalog.entries()}
        out: dict[str, int] = {}

        def ask(pins: Any, chains: Any) -> None:
            if type(chains) is not int or not isinstance(pins, list | tuple) or chains <= 1:
                return
            for p in pins[:MAX_PINS]:
                if isinstance(p, str) and p.casefold() in names:
                    name = names[p.casefold()]
                    out[name] = max(out.get(name, 1), min(chains, MAX_CHAINS))

        ask(self.pins, self.chains)
        for pid, v in views.items():
            if v.state != PeerState.DEAD and pid != self.gossip.peer_id:
                ask(v.record.extras.get(PINS_KEY), v.record.extras.get(CHAINS_KEY))
        return out

    def _publish(self) -> None:
        """This agent's demand and pins in its record, when they changed."""
        now = self._clock()
        mine = (self.meter.to_cbor(now=now), list(self.pins[:MAX_PINS]))
        if mine == self._published:
            return
        me = self.gossip.snapshot().get(self.gossip.peer_id)
        extras = dict(me.record.extras) if me is not None else {}
        extras[demands.EXTRAS_KEY], extras[PINS_KEY] = mine
        if self.chains > 1:
            extras[CHAINS_KEY] = self.chains
        try:
            self.gossip.update_local(extras=extras)
        except MeshError as e:
            log.warning("assigning.publish_failed", error=str(e))
            return
        self.gossip.spread_now()
        self._published = mine


def _plans_in_force(views: Mapping[str, Any], models: Mapping[str, Any]) -> dict[str, Plan]:
    """Each model's plan in force, as the claims peers gossip say."""
    out = {}
    for name, cost in models.items():
        winner = plan_in_force(claims_for(name, views, cost.n_layers))
        if winner is not None:
            out[name] = winner.plan
    return out
