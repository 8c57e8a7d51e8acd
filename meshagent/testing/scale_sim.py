"""Hundreds of agents serving several big models under churn, simulated on a virtual clock.

What runs for real:
- **Membership**: every agent's SWIM state machine on the signed bus (`swim_bus.py`): its
  identity, signed updates and records, the wire codec, inter-city latencies. An agent's
  *view* is the members it holds alive or suspect, as its own state machine says.
- **The assignment**: each agent plans from its own view (`assignment.assign` over the offers
  of the members it sees, with the plans in force as `current`, the holders of each file
  preferred). Agents with the same view compute the same assignment, so it is computed once
  per distinct view; one new view in `ORDER_CHECK_EVERY` is also computed with its peers in
  a shuffled order, and the two must agree (what every agent computing the same plan rests
  on). An agent proposes only where the quorum lets it (`placement/quorum.py`), counted from
  the departures and arrivals of its own view.
- **Claims in records**: each change of an agent's claims (it follows a new plan as one of its
  peers or its proposer; its part is loaded) republishes its signed record with the claims in
  `extras["placement"]`, encoded as the agent encodes them (`negotiation.Claim`), so the
  gossip cost counts them.

What is modelled:
- **Formation**: placement begins once every view is full (an agent plans while the mesh
  forms too, but hundreds of views that differ would cost an assignment each).
- **Negotiation.** The agents whose view gives a plan other than the one in force propose it
  at the next epoch; the lowest proposer id wins (`negotiation.plan_in_force`'s rule), and the
  plan is in force on its side of any partition `CLAIM_S` later. A plan's peers load their
  parts once it has been in force `SETTLE_S` (`REPAIR_SETTLE_S` for a repair: the same
  layers with a lost stage given to another peer), as `PlacementService` does. After a
  partition heals, the plan in force with the higher claim wins everywhere.
- **Loading**: `LOAD_FIXED_S` plus the stage's weights over the peer's disk rate, plus a
  download at its network rate where it does not hold the model's file. A part kept by a new
  plan (same peer, same layers) keeps its engine.
- **Requests**: Poisson arrivals per model, each at an agent drawn at random (the client's
  own agent, its entry). A request takes a slot of the model's chain (`SLOTS` per chain;
  queued past that), prefills its prompt, then decodes at the chain's true time per token:
  stage compute at the peers' speeds and one trip round the ring at the true RTTs. A chain
  that loses a stage (its agent crashed or is cut off by a partition, or its plan was
  superseded) interrupts its requests: each waits for its model to be routable again from
  its entry's side, and replays its prompt and the tokens it has (a prefill), for at most
  `REPLAY_DEADLINE_S` from the loss, the agent's default `--replay-deadline`. Past that it
  fails with the reason. A request whose entry agent crashes fails: its client's
  connection was to that agent.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from meshagent.net.coordinates import Coordinate, update
from meshagent.placement import quorum
from meshagent.placement.assignment import Assignment, assign
from meshagent.placement.costs import BATCH_STEP, PREFILL_SHARE, decode_work
from meshagent.placement.demand import BUCKET_S, WINDOW_S, Bucket, Demand
from meshagent.placement.negotiation import Claim, plan_digest
from meshagent.placement.planner import ModelCost, PeerCapacity, is_repair
from meshagent.placement.service import EXTRAS_KEY
from meshagent.testing.scale_mesh import AgentSpec, big_models, draw_agent
from meshagent.testing.scale_state import (
    Chain,
    Force,
    Part,
    Request,
    Tally,
    plan_chains,
    plan_ranges,
)
from meshagent.testing.scale_tokens import FakeChains, prompt_of
from meshagent.testing.swim_bus import SwimBus

CONTEXT_TOKENS = 8192  # the agent's default: 4 slots of 2048
SLOTS = 4
HEADROOM = 0.1
TICK_S = 0.5  # how often requests advance and loads are judged
DECIDE_S = 1.0  # how often agents decide (PlacementService: on every change, at least 1/s)
CLAIM_S = 1.0  # a claim reaches every agent: a record change at 300 members on the bus
SETTLE_S = 2.0  # a new plan must stay in force this long before its parts load
REPAIR_SETTLE_S = 0.25
LOAD_FIXED_S = 2.0
REPLAY_DEADLINE_S = 30.0
ORDER_CHECK_EVERY = 4  # one new view in this many is planned again in a shuffled order
ENTRY_STOPPED = "its client's own agent stopped"  # the request's client was connected there
MEASURED = 8  # peers whose RTT an agent measures (3 in its city): a bounded connection set


class ScaleSim:
    def __init__(
        self,
        n: int,
        *,
        seed: int = 1,
        models: Mapping[str, ModelCost] | None = None,
        cities: int = 3,
        request_every_s: float = 2.0,  # the shortest mean gap between requests of a model
        prompt: int = 200,
        output: int = 128,
        claims_by: str = "plan",
        quorum: bool = True,
    ) -> None:
        """`claims_by`: "plan" (the plan's peers and its proposer claim it, as
        `PlacementService` does) or "all" (every agent claims the plan it follows, as it did
        before this simulation measured what that costs). `quorum`: an agent that sees fewer
        agents than it lost lately proposes nothing (`placement/quorum.py`), as the agent
        does; False: as it did before."""
        self.claims_by = claims_by
        self.quorum = quorum
        self.rng = random.Random(seed)
        self.models = dict(models or big_models())
        self.bus = SwimBus(seed=seed, signed=True, cities=cities)
        self.request_every_s = request_every_s
        self.prompt, self.output = prompt, output
        self.specs: dict[str, AgentSpec] = {}
        self.coords: dict[str, Coordinate] = {}
        self.measured: dict[str, dict[str, float]] = {}
        self.force: list[dict[str, Force]] = [{}]  # per side
        self.pending: list[dict[str, tuple[Force, float]]] = [{}]
        self.parts: dict[tuple[str, str], Part] = {}  # (peer, model)
        self.claims: dict[str, dict[str, Claim]] = {}  # what each agent publishes
        self.requests: list[Request] = []
        self.queue: list[Request] = []  # waiting for a slot or a chain
        self.tally = Tally()
        self.fake = FakeChains(SLOTS, prompt + output + 8)  # every request's tokens
        self._views: dict[str, tuple[bytes, frozenset[str]]] = {}
        self._plans: dict[tuple, Assignment] = {}
        self._rid = 0
        self._next_request: dict[str, float] = {}
        self._next_decision = 0.0
        self._turnover: dict[str, quorum.Turnover] = {}  # by agent, of its view
        self.request_every: dict[str, float] = {}  # mean seconds between requests per model
        self.names = self._grow(n)

    # ----- the mesh -----

    def _grow(self, n: int) -> list[str]:
        names: list[str] = []
        for i in range(n):
            if i:
                self.bus.run_until(self.bus.now + 0.01)
            names.append(self.join(names[self.rng.randrange(i)] if i else None))
        return names

    def join(self, contact: str | None) -> str:
        """A new agent, joining through `contact` (none: the first)."""
        name = self.bus.new_name()
        self.specs[name] = draw_agent(name, self.rng, sorted(self.models))
        self.bus.add(name, contact=contact)
        self._place_coordinate(name)
        return name

    def _place_coordinate(self, name: str) -> None:
        """The agent measures `MEASURED` others (3 in its city, the rest anywhere) and moves
        its coordinate with each sample (Vivaldi, `net/coordinates.py`), as its probes do;
        the others' coordinates move with it."""
        others = [k for k in self.specs if k != name and k not in self.bus.crashed]
        if not others:
            self.coords[name] = Coordinate()
            self.measured[name] = {}
            return
        city = self.bus.city[name]
        near = [k for k in others if self.bus.city[k] == city]
        chosen = self.rng.sample(near, min(3, len(near)))
        rest = [k for k in others if k not in chosen]
        chosen += self.rng.sample(rest, min(MEASURED - len(chosen), len(rest)))
        self.measured[name] = {k: self.bus.rtt_ms(name, k) for k in chosen}
        for k, ms in self.measured[name].items():
            self.measured.setdefault(k, {})[name] = ms
        c = self.coords.get(name, Coordinate())
        for _ in range(30):
            for k in chosen:
                theirs = self.coords.get(k, Coordinate())
                sample = self.measured[name][k] * self.rng.uniform(0.97, 1.05)
                c = update(c, theirs, sample, self.rng)
                self.coords[k] = update(theirs, c, sample, self.rng)
        self.coords[name] = c

    def settle_coordinates(self, rounds: int = 40) -> None:
        """Every agent measures its peers again for a while (the mesh's first minute)."""
        names = sorted(self.coords)
        for _ in range(rounds):
            for a in names:
                for b, ms in sorted(self.measured[a].items()):
                    sample = ms * self.rng.uniform(0.97, 1.05)
                    self.coords[a] = update(self.coords[a], self.coords[b], sample, self.rng)

    def capacity(self, name: str, alive: frozenset[str]) -> PeerCapacity:
        """An agent's offer as its record gives it to the agents that see it: the RTTs it
        measured to peers they also see, and its coordinate."""
        rtts = {k: v for k, v in self.measured.get(name, {}).items() if k in alive}
        return replace(self.specs[name].offer, rtt_ms=rtts, coord=self.coords.get(name))

    def running(self) -> list[str]:
        return [k for k in self.bus.members if k not in self.bus.crashed]

    def side_of(self, name: str) -> int:
        return self.bus.side.get(name, 0)

    # ----- views and the assignment -----

    def view(self, name: str) -> frozenset[str]:
        """The members `name` holds alive or suspect; the departures and arrivals since it
        was last asked are noted with the time, as the placement service notes them between
        its decisions (`quorum.py`)."""
        m = self.bus.members[name]
        digest = m.digest()
        held = self._views.get(name)
        if held is None or held[0] != digest:
            alive = frozenset(m.alive())
            self._turnover.setdefault(name, quorum.Turnover()).note(alive, self.bus.now)
            held = (digest, alive)
            self._views[name] = held
        return held[1]

    def assignment(self, view: frozenset[str], side: int) -> Assignment:
        force = self.force[side]
        demand = tuple(sorted(self.request_every.items()))  # what the agents gossip of it
        key = (view, tuple(sorted((m, f.key) for m, f in force.items())), demand)
        got = self._plans.get(key)
        if got is None:
            got = self._assign(sorted(view), force)
            if len(self._plans) % ORDER_CHECK_EVERY == 0:
                shuffled = sorted(view)
                random.Random(len(self._plans)).shuffle(shuffled)
                self.tally.order_checks += 1
                if self._assign(shuffled, force) != got:
                    self.tally.disagreements += 1
            self._plans[key] = got
            self.tally.assignments += 1
        return got

    def _assign(self, ids: Sequence[str], force: Mapping[str, Force]) -> Assignment:
        alive = frozenset(ids)
        t = time.perf_counter()
        # A bucket's start: the window holds whole buckets only (see `_demand`).
        now = (self.bus.now + 1_000_000.0) // BUCKET_S * BUCKET_S
        demand = {m: self._demand(m, now) for m in self.models}
        got = assign(
            self.models,
            [self.capacity(k, alive) for k in ids],
            demand,
            now=now,
            context_tokens=CONTEXT_TOKENS,
            headroom=HEADROOM,
            pins=frozenset(self.models),
            current={m: f.plan for m, f in force.items()},
            holders={m: frozenset(k for k in ids if m in self.specs[k].holds) for m in self.models},
            streams=SLOTS,
        )
        self.tally.assign_s.append(time.perf_counter() - t)
        return got

    def _demand(self, model: str, now: float) -> Demand:
        """`model`'s demand as the agents gossip it: every bucket of the window holding the
        work its requests ask for at their mean rate, in decoded tokens (`decode_work`;
        none before requests begin). `now`: the start of a bucket, the window's buckets
        those before it (a running bucket counted whole would overstate the rate)."""
        every = self.request_every.get(model)
        work = decode_work(self.prompt, self.output)
        per_bucket = 0 if every is None else work * BUCKET_S / every
        first = int(now // BUCKET_S) - 1
        buckets = tuple(
            Bucket(first - i, max(1, round(BUCKET_S / every)) if every else 0, round(per_bucket))
            for i in reversed(range(int(WINDOW_S // BUCKET_S)))
        )
        return Demand(buckets=buckets, last_used=now, expires_at=now + 300, in_flight=1)

    def decide(self) -> None:
        """Each side: the agents whose view gives another plan than the one in force propose
        it; the lowest proposer's plan comes into force `CLAIM_S` later."""
        now = self.bus.now
        for side in range(len(self.force)):
            for model, (force, at) in sorted(self.pending[side].items()):
                if now >= at:
                    del self.pending[side][model]
                    self._adopt(side, model, force)
            members = sorted(k for k in self.running() if self.side_of(k) == side)
            by_view: dict[frozenset[str], str] = {}
            for k in members:
                by_view.setdefault(self.view(k), k)  # its lowest member proposes first
            for view, proposer in sorted(by_view.items(), key=lambda kv: kv[1]):
                if all(m in self.pending[side] for m in self.models):
                    break  # every model has a proposal under way: later ones lose to it
                turnover = self._turnover[proposer]
                if self.quorum and turnover.cut_off(len(view), now) is not None:
                    self.tally.cut_off += 1
                    continue  # it sees fewer agents than it lost lately: it proposes nothing
                wanted = self.assignment(view, side)
                for model in sorted(self.models):
                    if model in self.pending[side]:
                        continue
                    placed = wanted.get(model)
                    force = self.force[side].get(model)
                    if placed is None:
                        continue  # no plan from this view: requests will say why
                    if force is not None and plan_digest(force.plan) == plan_digest(placed.plan):
                        continue
                    epoch = 1 + max(
                        (f.epoch for s in self.force for m, f in s.items() if m == model),
                        default=0,
                    )
                    repair = force is not None and is_repair(force.plan, placed.plan)
                    new = Force(placed.plan, epoch, proposer, now + CLAIM_S, repair)
                    self.pending[side][model] = (new, now + CLAIM_S)
                    self.tally.proposals += 1

    def _adopt(self, side: int, model: str, force: Force) -> None:
        """`force` is in force on `side`: the parts no longer in it stop serving (their
        requests replay), its peers load theirs once it has settled, and the agents claim it."""
        self.force[side][model] = force
        n = len(plan_chains(force.plan, self.models[model]))
        self.tally.chains_most[model] = max(n, self.tally.chains_most.get(model, 0))
        ranges = plan_ranges(force.plan, self.models[model])
        for (peer, m), part in list(self.parts.items()):
            here = m == model and self.side_of(peer) == side
            if here and ranges.get(peer) != (part.start, part.end):
                del self.parts[(peer, m)]
        begin = max(self.bus.now, _settled_at(force))
        for peer, (start, end) in sorted(ranges.items()):
            if peer in self.bus.crashed or self.side_of(peer) != side:
                continue
            if (peer, model) not in self.parts:
                ready = begin + self.load_s(peer, model, start, end)
                self.parts[(peer, model)] = Part(start, end, ready)
        for peer in self._claimants(side, model, force):
            self._claim(peer, model, force)

    def _claimants(self, side: int, model: str, force: Force) -> list[str]:
        if self.claims_by == "all":
            return sorted(k for k in self.running() if self.side_of(k) == side)
        peers = {*force.plan.peers, force.proposer}
        return sorted(k for k in peers if k not in self.bus.crashed and self.side_of(k) == side)

    def load_s(self, peer: str, model: str, start: int, end: int) -> float:
        spec = self.specs[peer]
        size = self.models[model].weight_bytes(start, end)
        seconds = LOAD_FIXED_S + size / spec.disk_bps
        if model not in spec.holds:
            seconds += size / spec.net_bps
        return seconds

    def _claim(self, peer: str, model: str, force: Force) -> None:
        """`peer` publishes its claim on `model`: ready once its part is loaded (an agent
        outside the plan, once the plan has settled)."""
        now = self.bus.now
        part = self.parts.get((peer, model))
        if peer in force.plan.peers:
            ready = part is not None and part.ready_at <= now
        else:
            ready = now >= _settled_at(force)
        claim = Claim(model, force.epoch, force.proposer, force.plan, ready)
        held = self.claims.setdefault(peer, {})
        if held.get(model) == claim:
            return
        held[model] = claim
        extras = {EXTRAS_KEY: {m: c.to_cbor() for m, c in sorted(held.items())}}
        self.tally.record_bytes.append(self.bus.republish(peer, extras=extras))

    def claims_ready(self) -> None:
        """Agents claim ready what they can: their part loaded, or the plan settled."""
        for side, forces in enumerate(self.force):
            for model, force in sorted(forces.items()):
                for peer in self._claimants(side, model, force):
                    held = self.claims.get(peer, {}).get(model)
                    if held is None or not held.ready or held.epoch != force.epoch:
                        self._claim(peer, model, force)

    def routable(self, model: str, side: int) -> Force | None:
        """The plan in force on `side` where one of its chains (or replicas) serves."""
        force = self.force[side].get(model)
        return force if force is not None and self.chains(model, side) else None

    def chains(self, model: str, side: int) -> list[Chain]:
        """The chains (a replica is a chain of one stage) of `model`'s plan in force on
        `side` whose every part is loaded there."""
        force = self.force[side].get(model)
        if force is None:
            return []
        out = []
        for chain in plan_chains(force.plan, self.models[model]):
            if all(self._serves(model, side, peer, start, end) for peer, start, end in chain):
                out.append(chain)
        return out

    def _serves(self, model: str, side: int, peer: str, start: int, end: int) -> bool:
        part = self.parts.get((peer, model))
        return (
            peer not in self.bus.crashed
            and self.side_of(peer) == side
            and part is not None
            and (part.start, part.end) == (start, end)
            and part.ready_at <= self.bus.now
        )

    def why_not(self, model: str, side: int) -> str:
        """Why `model` is not routable from `side` now, in words."""
        force = self.force[side].get(model)
        anyone = next((k for k in sorted(self.running()) if self.side_of(k) == side), None)
        if anyone is not None:
            placed = self.assignment(self.view(anyone), side)
            why = placed.reason(model)
            if placed.get(model) is None:
                return f"no plan on this side: {why or 'not placed'}"
        if force is None:
            return "no plan in force"
        ranges = plan_ranges(force.plan, self.models[model])
        for peer, (start, end) in sorted(ranges.items()):
            part = self.parts.get((peer, model))
            if peer in self.bus.crashed:
                return f"stage {start}-{end} on {peer[:8]}: its agent crashed, not yet replaced"
            if self.side_of(peer) != side:
                where = (
                    "this agent is on the small side of a cut"
                    if side
                    else "across a cut, not yet replaced"
                )
                return f"stage {start}-{end} on {peer[:8]}: {where}"
            if part is not None and part.ready_at > self.bus.now:
                left = part.ready_at - self.bus.now
                held = model in self.specs[peer].holds
                how = "loading" if held else "downloading and loading"
                return f"stage {start}-{end} on {peer[:8]} still {how} ({left:.0f} s left)"
        return "not routable"

    # ----- requests -----

    def arrivals(self, start: float) -> None:
        now = self.bus.now
        for model in sorted(self.models):
            t = self._next_request.setdefault(model, start)
            every = self.request_every.get(model, self.request_every_s)
            while t <= now:
                entries = self.running()
                self._rid += 1
                r = Request(self._rid, model, self.rng.choice(entries), t, self.prompt, self.output)
                self.requests.append(r)
                self.queue.append(r)
                t += self.rng.expovariate(1.0 / every)
            self._next_request[model] = t

    def chain_token_s(self, model: str, chain: Chain, batch: int) -> float:
        """Seconds per decoded token of `chain` with `batch` sequences in a step."""
        cost = self.models[model]
        compute = 0.0
        per_layer = 1e9 / cost.flops_per_layer
        for peer, start, end in chain:
            o = self.specs[peer].offer
            scaled = replace(o, speed=o.speed * per_layer, vram_speed=o.vram_speed * per_layer)
            compute += scaled.stage_ms(cost, start, end, CONTEXT_TOKENS)
        peers = [peer for peer, _, _ in chain]
        ring = sum(
            self.bus.rtt_ms(peers[i], peers[(i + 1) % len(peers)])
            for i in range(len(peers))
            if len(peers) > 1
        )
        return (compute * (1 + BATCH_STEP * (batch - 1)) + ring) / 1000.0

    def chains_of(self, model: str, side: int = 0) -> list[Chain]:
        """Every chain of `model`'s plan in force on `side`, serving or not."""
        force = self.force[side].get(model)
        return [] if force is None else plan_chains(force.plan, self.models[model])

    def first_chain(self, model: str, side: int = 0) -> Chain:
        """The first chain of `model`'s plan in force on `side`."""
        return plan_chains(self.force[side][model].plan, self.models[model])[0]

    def serve(self, dt: float) -> None:
        """Requests in flight advance by `dt`; lost ones wait, replay or fail; queued ones
        start where a chain has a slot."""
        now = self.bus.now
        running: dict[tuple, list[Request]] = {}
        for r in self.requests:
            if r.finished is None and not r.failed and r.chain is not None:
                running.setdefault((r.model, r.chain), []).append(r)
        for (model, chain), rs in sorted(running.items(), key=lambda kv: kv[1][0].rid):
            side = self.side_of(rs[0].entry)
            if chain not in self.chains(model, side):
                for r in rs:
                    self._lose(r)
                continue
            step = self.chain_token_s(model, chain, len(rs))
            for r in rs:
                if r.entry in self.bus.crashed:
                    r.failed = ENTRY_STOPPED
                    self.fake.release(r.rid)
                    continue
                start = max(now - dt, r.busy_until)
                if start < now:
                    r.done += (now - start) / step
                self.fake.decode(r.rid, r.tokens, min(int(r.done), r.output))
                if r.done >= r.output:
                    r.finished = now
                    self.fake.release(r.rid)
        slots: dict[tuple, int] = {}
        for (model, key), rs in running.items():
            slots[(model, key)] = sum(1 for r in rs if r.finished is None and not r.failed)
        waiting = []
        for r in self.queue:
            if r.entry in self.bus.crashed:
                r.failed = ENTRY_STOPPED
                continue
            chains = self.chains(r.model, self.side_of(r.entry))
            if not chains:
                if r.no_chain_since is None:
                    r.no_chain_since = now
                if now - r.no_chain_since > REPLAY_DEADLINE_S:
                    r.failed = self.why_not(r.model, self.side_of(r.entry))
                    continue
                waiting.append(r)
                continue
            r.no_chain_since = None
            # The chain with the most free slots (the API's least busy), then the first.
            chain = min(chains, key=lambda c: slots.get((r.model, c), 0))
            if slots.get((r.model, chain), 0) >= SLOTS:
                waiting.append(r)  # waiting for a slot is no failure
                continue
            slots[(r.model, chain)] = slots.get((r.model, chain), 0) + 1
            # It prefills its prompt and the tokens it has on this chain (a replay: what it
            # had decoded on the chain it lost), and decodes on from there.
            r.done = len(r.tokens)
            self.fake.start(
                r.rid, (r.model, chain), len(chain), prompt_of(r.rid, r.prompt) + r.tokens
            )
            tokens = r.prompt + len(r.tokens)
            compute = self.chain_token_s(r.model, chain, 1)
            r.busy_until = now + tokens * compute * PREFILL_SHARE + compute
            r.chain = chain
            if r.lost_at is not None:
                r.waited_s += now - r.lost_at
                r.replays += 1
                r.lost_at = None
        self.queue = waiting

    def _lose(self, r: Request) -> None:
        self.fake.release(r.rid)
        if r.entry in self.bus.crashed:
            r.failed = ENTRY_STOPPED
            return
        r.chain = None
        r.lost_at = r.no_chain_since = self.bus.now
        self.queue.append(r)

    # ----- churn -----

    def crash(self, name: str) -> None:
        self.bus.crash(name)
        for key in [k for k in self.parts if k[0] == name]:
            del self.parts[key]

    def partition(self, away: set[str]) -> None:
        self.bus.partition(away)
        self.force = [self.force[0], dict(self.force[0])]
        self.pending = [self.pending[0], dict(self.pending[0])]

    def heal(self) -> None:
        """Messages cross again; once the claims cross (`CLAIM_S`), each model's plan in
        force is the higher claim of the two sides', everywhere."""
        self.bus.heal()
        if len(self.force) == 1:
            return
        at = self.bus.now + CLAIM_S
        merged: dict[str, tuple[Force, float]] = {}
        for model in sorted(self.models):
            rivals = [f for s in self.force if (f := s.get(model)) is not None]
            rivals += [f for s in self.pending if (f := s.get(model, (None,))[0]) is not None]
            if rivals:
                win = min(rivals, key=lambda f: (-f.epoch, f.proposer, plan_digest(f.plan)))
                merged[model] = (win, at)
        self.force, self.pending = [dict(self.force[0])], [merged]

    # ----- running -----

    def step(self, requests_from: float | None) -> None:
        self.bus.run_until(self.bus.now + TICK_S)
        if self.bus.now >= self._next_decision:
            self._next_decision = self.bus.now + DECIDE_S - 1e-9
            self.decide()
        self.claims_ready()
        if requests_from is not None:
            self.arrivals(requests_from)
        self.serve(TICK_S)

    def set_load(self, load: float) -> dict[str, float]:
        """Requests for each model arrive `load` times as often as its chain in force can
        serve them with every slot busy (each request alone on its chain's time per token);
        the mean seconds between requests of each model."""
        for model in sorted(self.force[0]):
            token_s = self.chain_token_s(model, self.first_chain(model), SLOTS)
            request_s = self.prompt * PREFILL_SHARE * token_s + self.output * token_s
            self.request_every[model] = max(self.request_every_s, request_s / (SLOTS * load))
        return dict(self.request_every)

    def all_routable(self) -> bool:
        return all(self.routable(m, 0) is not None for m in self.models)


def _settled_at(force: Force) -> float:
    """When a plan in force has settled: its parts load, agents outside it claim it ready."""
    return force.since + (REPAIR_SETTLE_S if force.repair else SETTLE_S)


__all__ = ["ScaleSim"]
