"""Many models on one mesh, simulated: a demand trace, the assignment every agent computes at
every step, load times, tokens served; and an offline optimum on the same trace.

In process, deterministic, on a simulated clock (every `step_s` seconds). Each step:
1. every agent's `DemandMeter` records the end of the requests of the step before, with
   their tokens, and the beginning of this step's (the trace's tokens per second of each
   model, spread over the agents): a model in demand has requests in flight while the
   agents assign, as a request waits on its model in the mesh;
2. each agent gossips its meter (`demand.to_cbor`, through CBOR bytes), every agent decodes
   every peer's form (`demand.from_cbor`) and sums them (`demand.merge`) in an order of its
   own, and computes the assignment (`assignment.assign`) with the peers and models in an
   order of its own; the step notes whether all of them came out identical;
3. the mesh follows the assignment: each new part (a replica, or a stage) loads for its
   weights' bytes over the peer's disk rate, plus a download at its network rate when the
   peer does not hold the file yet; a part no longer assigned is gone at once;
4. tokens are served for the step: each model's demand, routed over its parts that are
   loaded, each peer's compute shared among the models it serves (`serve`). Nothing is
   served by a part while it loads.

The offline optimum and an upper bound on the same trace: `assignment_optimum.py`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import cbor2

from meshagent.placement import demand as demand_mod
from meshagent.placement.assignment import Assignment, Placed, assign
from meshagent.placement.demand import DemandMeter
from meshagent.placement.planner import ModelCost, PeerCapacity, Plan

GB = 1_000_000_000
CONTEXT_TOKENS = 8192
HEADROOM = 0.1
LOAD_FIXED_S = 2.0  # starting a part: opening the file, allocating, warming up


@dataclass(frozen=True)
class SimPeer:
    """One agent: its offer (speeds in GFLOP/s, as gossiped), its disk and network rates, and
    the model files it holds at the start."""

    capacity: PeerCapacity
    disk_bps: float
    net_bps: float
    holds: frozenset[str] = frozenset()

    @property
    def peer_id(self) -> str:
        return self.capacity.peer_id


@dataclass(frozen=True)
class SimModel:
    cost: ModelCost
    keep_alive: float | None = None  # seconds, as its requests send it (None: default)
    request_tokens: int = 500  # prompt and completion of a typical request

    @property
    def model_id(self) -> str:
        return self.cost.model_id


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Trace:
    """Each model's demand in tokens per second, one value per step."""

    step_s: float
    phases: tuple[Phase, ...]
    rates: Mapping[str, tuple[float, ...]]

    @property
    def steps(self) -> int:
        return len(next(iter(self.rates.values())))

    @property
    def duration_s(self) -> float:
        return self.steps * self.step_s

    def at(self, step: int) -> dict[str, float]:
        return {m: r[step] for m, r in sorted(self.rates.items())}


def model_cost(
    model_id: str,
    *,
    params_b: float,
    file_gb: float,
    n_layers: int,
    n_embd: int,
    n_vocab: int,
    kv_heads: int,
    head_dim: int = 128,
    tied: bool = False,
) -> ModelCost:
    """A Q4_K_M-like model of that shape: token embeddings at 4.5 bits a weight, an untied
    output head at 6.5 (a tied one is the embeddings, held once by a whole model), the
    layers the rest of the file; KV cache at f16."""
    embedding = int(n_vocab * n_embd * 0.5625)
    head = embedding if tied else int(n_vocab * n_embd * 0.8125)
    layers = int(file_gb * GB) - embedding - (0 if tied else head)
    layer_params = params_b * 1e9 - n_vocab * n_embd * (1 if tied else 2)
    return ModelCost(
        model_id=model_id,
        n_layers=n_layers,
        layer_bytes=(layers // n_layers,) * n_layers,
        embedding_bytes=embedding,
        head_bytes=head,
        other_bytes=0,
        kv_bytes_per_token_per_layer=2 * kv_heads * head_dim * 2,
        flops_per_layer=2.0 * layer_params / n_layers,
        tied_embeddings=tied,
        n_embd=n_embd,
        n_vocab=n_vocab,
        tokenizer_bytes=7_000_000,
    )


def team_models() -> list[SimModel]:
    """Six models from 0.4 to 40 GB, shaped like Qwen2.5 0.5B, 1.5B, Coder 7B, 14B, 32B and
    Llama 3.1 70B at Q4."""
    return [
        SimModel(model_cost("embed-0.5b", params_b=0.49, file_gb=0.40, n_layers=24, n_embd=896,
                            n_vocab=151936, kv_heads=2, head_dim=64, tied=True), None, 200),
        SimModel(model_cost("small-1.5b", params_b=1.54, file_gb=0.99, n_layers=28, n_embd=1536,
                            n_vocab=151936, kv_heads=2, tied=True), None, 400),
        SimModel(model_cost("coder-7b", params_b=7.6, file_gb=4.68, n_layers=28, n_embd=3584,
                            n_vocab=152064, kv_heads=4), None, 600),
        SimModel(model_cost("chat-14b", params_b=14.7, file_gb=8.99, n_layers=48, n_embd=5120,
                            n_vocab=152064, kv_heads=8), None, 800),
        SimModel(model_cost("chat-32b", params_b=32.8, file_gb=19.85, n_layers=64, n_embd=5120,
                            n_vocab=152064, kv_heads=8), None, 800),
        SimModel(model_cost("big-70b", params_b=70.6, file_gb=40.0, n_layers=80, n_embd=8192,
                            n_vocab=128256, kv_heads=8), None, 800),
    ]  # fmt: skip


def _peer(
    pid: str,
    ram_gb: float,
    cpu: float,
    *,
    vram_gb: float = 0.0,
    gpu: float = 0.0,
    spare_gb: float = 1.0,
    disk: float = 1.0,
    net: float = 0.11,
    holds: Sequence[str] = (),
) -> SimPeer:
    cap = PeerCapacity(
        pid,
        int(ram_gb * GB),
        cpu,
        vram_bytes=int(vram_gb * GB),
        vram_speed=gpu,
        spare_bytes=int(spare_gb * GB),
    )
    return SimPeer(cap, disk * GB, net * GB, frozenset(holds))


def team_mesh() -> list[SimPeer]:
    """Twelve agents: laptops (4 GB offered), desktops (8), workstations (16), GPU boxes
    with 8, 24, 24, 48 and 80 GB of VRAM. Speeds are effective GFLOP/s of decoding (a 7B at
    Q4 runs about 5 tokens/s on a laptop, 150 on the 80 GB GPU); disks 0.5-3 GB/s, the LAN
    1 Gbit/s (10 Gbit/s between the GPU boxes); Wi-Fi laptops 0.05 GB/s."""
    small = ("embed-0.5b", "small-1.5b")
    return [
        _peer("laptop-1", 4, 60, disk=0.5, net=0.05, holds=small),
        _peer("laptop-2", 4, 60, disk=0.5, net=0.05, holds=small),
        _peer("desk-1", 8, 100, spare_gb=2, holds=small),
        _peer("desk-2", 8, 100, spare_gb=2, holds=small),
        _peer("mini-1", 8, 120, disk=2, holds=small),
        _peer("work-1", 16, 150, spare_gb=4, disk=1.5, holds=(*small, "coder-7b")),
        _peer("work-2", 16, 150, spare_gb=4, disk=1.5, holds=(*small, "coder-7b")),
        _peer("gpu-8", 16, 150, vram_gb=8, gpu=800, spare_gb=4, disk=2,
              holds=(*small, "coder-7b")),
        _peer("gpu-24a", 16, 150, vram_gb=24, gpu=1300, spare_gb=8, disk=3, net=1.1,
              holds=(*small, "coder-7b", "chat-14b")),
        _peer("gpu-24b", 16, 150, vram_gb=24, gpu=1100, spare_gb=8, disk=3, net=1.1,
              holds=(*small, "coder-7b", "chat-14b")),
        _peer("gpu-48", 32, 200, vram_gb=48, gpu=1500, spare_gb=8, disk=3, net=1.1,
              holds=(*small, "coder-7b", "chat-14b", "chat-32b")),
        _peer("gpu-80", 48, 250, vram_gb=80, gpu=2000, spare_gb=16, disk=3, net=1.1,
              holds=(*small, "coder-7b", "chat-14b", "chat-32b", "big-70b")),
    ]  # fmt: skip


# Each phase: (name, minutes, {model: mean tokens/s}).
TEAM_PHASES: tuple[tuple[str, float, dict[str, float]], ...] = (
    ("coding", 20, {"embed-0.5b": 150, "coder-7b": 150, "chat-14b": 15}),
    ("design review", 20, {"embed-0.5b": 100, "coder-7b": 50, "chat-14b": 30, "chat-32b": 40}),
    ("trying the 70B", 20, {"embed-0.5b": 100, "coder-7b": 100, "chat-32b": 10, "big-70b": 18}),
    ("batch summaries", 20, {"embed-0.5b": 100, "small-1.5b": 400, "coder-7b": 150,
                             "chat-14b": 20}),
    ("crunch", 20, {"embed-0.5b": 250, "coder-7b": 320, "chat-14b": 60, "small-1.5b": 40}),
    ("evening", 20, {"embed-0.5b": 60, "small-1.5b": 30, "coder-7b": 25}),
)  # fmt: skip


def shifting_trace(
    phases: Sequence[tuple[str, float, Mapping[str, float]]] = TEAM_PHASES,
    *,
    models: Sequence[str] = tuple(m.model_id for m in team_models()),
    step_s: float = 10.0,
    seed: int = 7,
    bursts_per_hour: float = 6.0,
) -> Trace:
    """Demand that shifts phase by phase: each model's mean for the phase, a wobble of
    +-25% step to step, ramps of a minute at the phase's edges, and bursts (a model's demand
    tripled for 1-3 minutes) at random moments."""
    rng = random.Random(seed)
    total = sum(minutes for _, minutes, _ in phases) * 60.0
    steps = int(total / step_s)
    out_phases, edges, t = [], [], 0.0
    for name, minutes, _ in phases:
        out_phases.append(Phase(name, t, t + minutes * 60.0))
        edges.append(t)
        t += minutes * 60.0
    rates: dict[str, list[float]] = {m: [0.0] * steps for m in models}
    for k in range(steps):
        now = k * step_s
        i = max(j for j, e in enumerate(edges) if e <= now)
        for m in models:
            here = phases[i][2].get(m, 0.0)
            before = phases[i - 1][2].get(m, 0.0) if i > 0 else here
            ramp = min(1.0, (now - edges[i]) / 60.0)
            mean = before + (here - before) * ramp
            if mean > 0:
                rates[m][k] = mean * rng.uniform(0.75, 1.25)
    n_bursts = int(bursts_per_hour * total / 3600.0)
    for _ in range(n_bursts):
        m = rng.choice(sorted(models))
        start = rng.randrange(steps)
        length = int(rng.uniform(60.0, 180.0) / step_s)
        for k in range(start, min(steps, start + length)):
            rates[m][k] *= 3.0
    return Trace(step_s, tuple(out_phases), {m: tuple(r) for m, r in sorted(rates.items())})


# Serving: parts, units, the router.


@dataclass(frozen=True)
class Part:
    """What one peer loads for a model: the whole model, or a stage's layers."""

    model_id: str
    peer_id: str
    start: int
    end: int


@dataclass(frozen=True)
class Unit:
    """Something that serves a model on its own: a replica, or a whole split. Each token
    costs `ms` of compute on each of its peers; at most `max_rate` tokens per second."""

    model_id: str
    parts: tuple[Part, ...]
    ms: tuple[float, ...]  # per part
    max_rate: float


def units_of(placed: Placed, model: ModelCost, context_tokens: int) -> list[Unit]:
    """The serving units of a placed model's plan."""
    caps = {c.peer_id: c for c in placed.peers}
    p = placed.plan
    n = model.n_layers
    if p.split:
        parts = tuple(Part(model.model_id, s.peer_id, s.start, s.end) for s in p.stages)
        ms = tuple(
            caps[s.peer_id].stage_ms(model, s.start, s.end, context_tokens) for s in p.stages
        )
        est = max(p.est_token_ms, sum(ms), 1e-9)
        return [Unit(model.model_id, parts, ms, 1000.0 / est)]
    out = []
    for pid in sorted(p.replicas):
        ms1 = max(caps[pid].stage_ms(model, 0, n, context_tokens), 1e-9)
        out.append(Unit(model.model_id, (Part(model.model_id, pid, 0, n),), (ms1,), 1000.0 / ms1))
    return out


ROUTER_ROUNDS = 4


def serve(demand: Mapping[str, float], units: Sequence[Unit]) -> dict[str, float]:
    """Tokens per second each model is served: its demand routed over its units in
    proportion to what each has left, every peer's compute (one second per second) shared in
    proportion to what is asked of it, what is left rerouted (`ROUTER_ROUNDS` rounds)."""
    units = sorted(units, key=lambda u: (u.model_id, tuple((p.peer_id, p.start) for p in u.parts)))
    unmet = {m: d for m, d in sorted(demand.items()) if d > 0}
    alloc = [0.0] * len(units)
    time_left: dict[str, float] = {}
    for u in units:
        for part in u.parts:
            time_left[part.peer_id] = 1.0
    for _ in range(ROUTER_ROUNDS):
        ask = [0.0] * len(units)
        for m in unmet:
            room = [
                (i, min(u.max_rate - alloc[i], _time_rate(u, time_left)))
                for i, u in enumerate(units)
                if u.model_id == m
            ]
            room_total = sum(r for _, r in room)
            if room_total <= 1e-9 or unmet[m] <= 1e-9:
                continue
            want = min(unmet[m], room_total)
            for i, r in room:
                ask[i] = want * r / room_total
        load: dict[str, float] = {}
        for i, u in enumerate(units):
            for part, ms in zip(u.parts, u.ms, strict=True):
                load[part.peer_id] = load.get(part.peer_id, 0.0) + ask[i] * ms / 1000.0
        scale = {
            p: 1.0 if load[p] <= time_left[p] else time_left[p] / load[p] for p in sorted(load)
        }
        moved = 0.0
        for i, u in enumerate(units):
            if ask[i] <= 0:
                continue
            got = ask[i] * min(scale[part.peer_id] for part in u.parts)
            alloc[i] += got
            unmet[u.model_id] -= got
            moved += got
            for part, ms in zip(u.parts, u.ms, strict=True):
                time_left[part.peer_id] = max(0.0, time_left[part.peer_id] - got * ms / 1000.0)
        if moved <= 1e-9:
            break
    served = {m: 0.0 for m in demand}
    for i, u in enumerate(units):
        served[u.model_id] += alloc[i]
    return served


def _time_rate(u: Unit, time_left: Mapping[str, float]) -> float:
    return min(
        time_left[p.peer_id] * 1000.0 / max(ms, 1e-9) for p, ms in zip(u.parts, u.ms, strict=True)
    )


# The mesh following assignments.


@dataclass
class World:
    """What each peer has loaded or is loading, what files it holds, and the tally."""

    peers: Mapping[str, SimPeer]
    models: Mapping[str, SimModel]
    context_tokens: int = CONTEXT_TOKENS
    ready_at: dict[Part, float] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)
    files: set[tuple[str, str]] = field(default_factory=set)  # (peer, model)
    ranges: set[Part] = field(default_factory=set)  # stages a peer downloaded
    moves: dict[str, list[float]] = field(default_factory=dict)  # model: times it changed
    changes: list[tuple[float, str, str]] = field(default_factory=list)  # (time, model, kind)
    evicted: set[str] = field(default_factory=set)  # unloaded while wanted
    loads: int = 0

    def __post_init__(self) -> None:
        for p in self.peers.values():
            self.files.update((p.peer_id, m) for m in p.holds)

    def holders(self) -> dict[str, frozenset[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.models}
        for pid, m in self.files:
            out.setdefault(m, set()).add(pid)
        return {m: frozenset(v) for m, v in sorted(out.items())}

    def load_s(self, part: Part) -> float:
        model = self.models[part.model_id].cost
        size = model.weight_bytes(part.start, part.end)
        peer = self.peers[part.peer_id]
        seconds = LOAD_FIXED_S + size / peer.disk_bps
        if (part.peer_id, part.model_id) not in self.files and part not in self.ranges:
            seconds += size / peer.net_bps
        return seconds

    def follow(
        self, placed: Mapping[str, Placed], now: float, wanted: frozenset[str] | None = None
    ) -> None:
        """Load what is newly assigned, drop what is no longer; tally each model's change.
        `wanted`: the models requested or pinned (None: all), whose unloading is an
        eviction, not keep_alive running out."""
        units = []
        for m in sorted(placed):
            units += units_of(placed[m], self.models[m].cost, self.context_tokens)
        wanted = {part for u in units for part in u.parts}
        before: dict[str, set[Part]] = {}
        for part in self.ready_at:
            before.setdefault(part.model_id, set()).add(part)
        after: dict[str, set[Part]] = {}
        for part in wanted:
            after.setdefault(part.model_id, set()).add(part)
        for m in sorted(set(before) | set(after)):
            old, new = before.get(m, set()), after.get(m, set())
            if old == new:
                continue
            kind = _kind(old, new)
            if kind == "unload" and (wanted is None or m in wanted):
                kind = "evict"
                self.evicted.add(m)
            elif kind == "load" and m in self.evicted:
                kind = "return"
            if kind == "load":
                self.evicted.discard(m)
            self.changes.append((now, m, kind))
            if kind not in ("load", "unload"):
                self.moves.setdefault(m, []).append(now)
        for part in [p for p in self.ready_at if p not in wanted]:
            del self.ready_at[part]
        for part in sorted(wanted - set(self.ready_at), key=_part_key):
            self.ready_at[part] = now + self.load_s(part)
            self.loads += 1
        self.units = units

    def advance(self, now: float) -> None:
        """Parts loaded by `now` leave their file (or stage) on the peer's disk."""
        for part, t in self.ready_at.items():
            if t <= now:
                if part.start == 0 and part.end == self.models[part.model_id].cost.n_layers:
                    self.files.add((part.peer_id, part.model_id))
                else:
                    self.ranges.add(part)

    def served(self, demand: Mapping[str, float], start: float, step_s: float) -> dict[str, float]:
        """Tokens served in [start, start + step_s): parts count from when they are loaded."""
        times = sorted({t for t in self.ready_at.values() if start < t < start + step_s})
        edges = [start, *times, start + step_s]
        total = {m: 0.0 for m in demand}
        for a, b in itertools.pairwise(edges):
            ready = [u for u in self.units if all(self.ready_at[p] <= a for p in u.parts)]
            for m, rate in serve(demand, ready).items():
                total[m] += rate * (b - a)
        return total


def _kind(old: set[Part], new: set[Part]) -> str:
    """What a change of a model's parts is: load (from none), unload (to none), grow (parts
    added only), shrink (removed only), or move (some of both). (`World.follow` tells an
    eviction, an unload while wanted, and the return of an evicted model.)"""
    if not old:
        return "load"
    if not new:
        return "unload"
    if old < new:
        return "grow"
    if new < old:
        return "shrink"
    return "move"


def _part_key(p: Part) -> tuple[str, str, int]:
    return (p.model_id, p.peer_id, p.start)


# Runs.


@dataclass
class SimResult:
    step_s: float
    demanded: dict[str, float]  # tokens over the run, by model
    served: dict[str, float]
    served_by_step: list[float]  # all models
    demanded_by_step: list[float]
    moves: dict[str, list[float]]  # model: times its placement changed
    loads: int
    changes: list[tuple[float, str, str]] = field(default_factory=list)  # (time, model, kind)
    identical: bool = True  # every agent computed the same assignment at every step
    differing_steps: int = 0
    gossip_bytes_max: int = 0  # the largest demand form an agent gossiped
    assignments: list[Assignment] = field(default_factory=list)  # at each step (online)
    configs: list[dict[str, Placed]] = field(default_factory=list)  # what was followed

    @property
    def total_served(self) -> float:
        return sum(self.served.values())

    @property
    def total_demanded(self) -> float:
        return sum(self.demanded.values())

    def max_moves_per_hour(self) -> tuple[int, str]:
        """The most moves of one model within any hour, and the model: changes of its
        placement, less loading it on demand and unloading it when its keep_alive ran out
        (an eviction, and the return after it, count)."""
        return _most_in_an_hour(self.moves)

    def max_changes_per_hour(self) -> tuple[int, str]:
        """The same counting every change, loads on demand and unloads too."""
        times: dict[str, list[float]] = {}
        for t, m, _ in self.changes:
            times.setdefault(m, []).append(t)
        return _most_in_an_hour(times)

    def served_between(self, start: float, end: float) -> float:
        return sum(s for k, s in enumerate(self.served_by_step) if start <= k * self.step_s < end)

    def demanded_between(self, start: float, end: float) -> float:
        return sum(s for k, s in enumerate(self.demanded_by_step) if start <= k * self.step_s < end)

    def moves_between(self, start: float, end: float) -> int:
        return sum(1 for ts in self.moves.values() for t in ts if start <= t < end)


def _most_in_an_hour(times: Mapping[str, Sequence[float]]) -> tuple[int, str]:
    best, who = 0, ""
    for m in sorted(times):
        ts = sorted(times[m])
        for i, t in enumerate(ts):
            n = sum(1 for x in ts[i:] if x < t + 3600.0)
            if n > best:
                best, who = n, m
    return best, who


def _tally(world: World, trace: Trace, k: int, result: SimResult) -> None:
    now = k * trace.step_s
    demand = trace.at(k)
    world.advance(now)
    got = world.served(demand, now, trace.step_s)
    for m, d in demand.items():
        result.demanded[m] = result.demanded.get(m, 0.0) + d * trace.step_s
        result.served[m] = result.served.get(m, 0.0) + got.get(m, 0.0)
    result.served_by_step.append(sum(got.values()))
    result.demanded_by_step.append(sum(d * trace.step_s for d in demand.values()))


def run_online(
    mesh: Sequence[SimPeer],
    models: Sequence[SimModel],
    trace: Trace,
    *,
    pins: frozenset[str] = frozenset(),
    agents: int | None = None,
    context_tokens: int = CONTEXT_TOKENS,
    headroom: float = HEADROOM,
    keep_assignments: bool = False,
) -> SimResult:
    """The mesh running `assign` on each of its agents (`agents` of them compute it; all by
    default) at every step of `trace`."""
    peers = {p.peer_id: p for p in mesh}
    by_id = {m.model_id: m for m in models}
    costs = {m.model_id: m.cost for m in models}
    world = World(peers, by_id, context_tokens)
    meters = {pid: DemandMeter() for pid in sorted(peers)}
    agent_ids = sorted(peers)[: agents or len(peers)]
    caps = [p.capacity for p in mesh]
    result = SimResult(trace.step_s, {}, {}, [], [], world.moves, 0, world.changes)
    current: dict[str, Plan] = {}
    for k in range(trace.steps):
        now = k * trace.step_s
        if k > 0:  # the requests of the step before end, having cost their tokens
            for meter, m, tokens in _requests(meters, by_id, trace, k - 1):
                meter.end(m, now=now, tokens=tokens, keep_alive=by_id[m].keep_alive)
        for meter, m, _ in _requests(meters, by_id, trace, k):
            meter.begin(m, now=now)  # this step's: in flight while the agents assign
        forms = []
        for pid in sorted(meters):
            wire = cbor2.dumps(meters[pid].to_cbor(now=now))
            result.gossip_bytes_max = max(result.gossip_bytes_max, len(wire))
            forms.append(demand_mod.from_cbor(cbor2.loads(wire)))
        mesh_demand = demand_mod.merge(forms)
        wanted = frozenset(
            m for m in costs if m in pins or (m in mesh_demand and mesh_demand[m].wanted(now))
        )
        holders = world.holders()
        first: Assignment | None = None
        for n, _agent in enumerate(agent_ids):
            rng = random.Random(k * 1009 + n)
            mine = forms[:]
            rng.shuffle(mine)
            order = caps[:]
            rng.shuffle(order)
            names = sorted(costs)
            rng.shuffle(names)
            got = assign(
                {m: costs[m] for m in names},
                order,
                demand_mod.merge(mine),
                now=now,
                context_tokens=context_tokens,
                headroom=headroom,
                pins=pins,
                current=current,
                holders=holders,
            )
            if first is None:
                first = got
            elif got != first:
                result.identical = False
                result.differing_steps += 1
                break
        assert first is not None
        placed = {p.model_id: p for p in first.placed}
        _check_memory(placed, peers)
        world.follow(placed, now, wanted)
        current = first.plans()
        if keep_assignments:
            result.assignments.append(first)
        result.configs.append(placed)
        _tally(world, trace, k, result)
    result.loads = world.loads
    return result


def _requests(
    meters: Mapping[str, DemandMeter], models: Mapping[str, SimModel], trace: Trace, k: int
) -> list[tuple[DemandMeter, str, int]]:
    """The requests of step `k`: (the agent's meter whose API takes it, round robin from a
    place of the model's own; model; tokens)."""
    agents = sorted(meters)
    out = []
    for i, m in enumerate(sorted(models)):
        tokens = round(trace.rates[m][k] * trace.step_s)
        if tokens <= 0:
            continue
        n = max(1, round(tokens / models[m].request_tokens))
        for j in range(n):
            meter = meters[agents[(k * 7 + i * 5 + j) % len(agents)]]
            out.append((meter, m, tokens // n + (1 if j < tokens % n else 0)))
    return out


def _check_memory(placed: Mapping[str, Placed], peers: Mapping[str, SimPeer]) -> None:
    """The shares given on each peer add up to no more than its offer."""
    used: dict[str, list[int]] = {}
    for p in placed.values():
        for c in p.peers:
            u = used.setdefault(c.peer_id, [0, 0])
            u[0] += c.memory_bytes
            u[1] += c.vram_bytes
    for pid, (memory, vram) in used.items():
        cap = peers[pid].capacity
        if memory > cap.memory_bytes or vram > cap.vram_bytes:
            raise AssertionError(f"{pid} is given {memory} + {vram} bytes, it offers less")


def run_schedule(
    mesh: Sequence[SimPeer],
    models: Sequence[SimModel],
    trace: Trace,
    schedule: Mapping[int, Mapping[str, Placed]],
    *,
    context_tokens: int = CONTEXT_TOKENS,
) -> SimResult:
    """The mesh following a fixed schedule: at each step that `schedule` names, the
    placements it gives (the others are kept)."""
    peers = {p.peer_id: p for p in mesh}
    world = World(peers, {m.model_id: m for m in models}, context_tokens)
    result = SimResult(trace.step_s, {}, {}, [], [], world.moves, 0, world.changes)
    for k in range(trace.steps):
        if k in schedule:
            placed = dict(schedule[k])
            _check_memory(placed, peers)
            world.follow(placed, k * trace.step_s)
            result.configs.append(placed)
        _tally(world, trace, k, result)
    result.loads = world.loads
    return result
