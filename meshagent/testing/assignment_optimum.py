"""The offline optimum of the many-models simulation (`assignment_sim.py`), and an upper bound.

The optimum (`optimum`) knows the whole trace. In each window (5 minutes) it follows one of a
set of candidate assignments: a greedy packer's (`pack`) for the window's mean and for its peak
demand, for the models in demand then and for each set of all of them but one, packed by demand
and biggest first, for that window and the next (to load ahead); and what the online assignment
chose at the window's start and middle. A dynamic program over the windows picks the sequence
that serves most tokens, each change paying for what its new parts do not serve while they load
(`_load_loss`). The schedule found is then run through the same simulation (`run_schedule`): its
figure is one the mesh could have reached, with load times and shared compute, but not
keep_alive (it unloads nothing it need not). An upper bound that ignores memory, load times and
sharing is reported beside it (`ceiling`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from meshagent.placement.assignment import Placed
from meshagent.placement.planner import ModelCost, PeerCapacity, PlanError, plan
from meshagent.placement.shares import replica_share
from meshagent.testing.assignment_sim import (
    CONTEXT_TOKENS,
    HEADROOM,
    LOAD_FIXED_S,
    Part,
    SimModel,
    SimPeer,
    SimResult,
    Trace,
    Unit,
    run_schedule,
    serve,
    units_of,
)


def ceiling(mesh: Sequence[SimPeer], models: Sequence[SimModel], trace: Trace) -> float:
    """Tokens no schedule can beat: each model alone on the mesh, a replica on every peer
    that holds it whole (each at its full speed), nothing loading, nothing shared."""
    caps = [p.capacity for p in mesh]
    best: dict[str, float] = {}
    for spec in models:
        model = spec.cost
        rate = 0.0
        for c in sorted(caps, key=lambda c: c.peer_id):
            cut = replica_share(
                model, _scaled(c, model), context_tokens=CONTEXT_TOKENS, headroom=HEADROOM
            )
            if cut is not None:
                rate += 1000.0 / max(cut.stage_ms(model, 0, model.n_layers, CONTEXT_TOKENS), 1e-9)
        best[spec.model_id] = rate
    return sum(
        min(d, best.get(m, 0.0)) * trace.step_s
        for k in range(trace.steps)
        for m, d in trace.at(k).items()
    )


def _scaled(c: PeerCapacity, model: ModelCost) -> PeerCapacity:
    per_layer = 1e9 / model.flops_per_layer if model.flops_per_layer > 0 else 1.0
    return replace(c, speed=c.speed * per_layer, vram_speed=c.vram_speed * per_layer)


# The offline optimum.

WINDOW_S = 300.0  # the optimum changes its assignment at most once per window
KEEP_STATES = 24  # states the dynamic program keeps from one window to the next
MIN_GAIN = 0.5  # tokens/s a replica must add to be packed


def pack(
    mesh: Sequence[SimPeer],
    models: Mapping[str, SimModel],
    demand: Mapping[str, float],
    chosen: Sequence[str],
    *,
    biggest_first: bool = False,
    context_tokens: int = CONTEXT_TOKENS,
    headroom: float = HEADROOM,
) -> dict[str, Placed]:
    """A greedy assignment for a known demand: one replica of each `chosen` model (by
    demand, or the biggest first), on the peer where it serves most of it; then replicas
    wherever they add the most tokens, each peer's compute counted once, until none adds
    `MIN_GAIN`. Models served whole only (a model no peer holds is left out)."""
    free = {p.peer_id: p.capacity for p in mesh}
    time_left = {pid: 1.0 for pid in free}
    unmet = {m: demand.get(m, 0.0) for m in chosen}
    shares: dict[str, dict[str, PeerCapacity]] = {}

    def option(m: str, pid: str) -> tuple[float, float, PeerCapacity] | None:
        model = models[m].cost
        cut = replica_share(
            model, _scaled(free[pid], model), context_tokens=context_tokens, headroom=headroom
        )
        if cut is None:
            return None
        rate = 1000.0 / max(cut.stage_ms(model, 0, model.n_layers, context_tokens), 1e-9)
        return min(unmet[m], rate * time_left[pid]), rate, cut

    def take(m: str, pid: str, gain: float, rate: float, cut: PeerCapacity) -> None:
        shares.setdefault(m, {})[pid] = cut
        f = free[pid]
        free[pid] = replace(
            f,
            memory_bytes=f.memory_bytes - cut.memory_bytes,
            vram_bytes=f.vram_bytes - cut.vram_bytes,
            spare_bytes=f.spare_bytes - cut.spare_bytes,
        )
        unmet[m] -= gain
        time_left[pid] -= gain / rate

    if biggest_first:
        first = sorted(
            chosen, key=lambda m: (-models[m].cost.weight_bytes(0, models[m].cost.n_layers), m)
        )
    else:
        first = sorted(chosen, key=lambda m: (-unmet[m], m))
    for m in first:
        options = [(o, pid) for pid in sorted(free) if (o := option(m, pid)) is not None]
        if options:
            (gain, rate, cut), pid = max(options, key=lambda x: (x[0][0], x[0][1], x[1]))
            take(m, pid, gain, rate, cut)
    while True:
        best = None
        for m in sorted(shares):
            for pid in sorted(free):
                if pid in shares[m]:
                    continue
                o = option(m, pid)
                if o is not None and (best is None or (o[0], o[1]) > (best[0][0], best[0][1])):
                    best = (o, m, pid)
        if best is None or best[0][0] < MIN_GAIN:
            break
        (gain, rate, cut), m, pid = best
        take(m, pid, gain, rate, cut)
    out = {}
    for m in sorted(shares):
        model = models[m].cost
        cut = [shares[m][pid] for pid in sorted(shares[m])]
        try:
            p = plan(model, cut, context_tokens=context_tokens, headroom=headroom)
        except PlanError:
            continue
        out[m] = Placed(m, tuple(cut), p, 0.0)
    return out


@dataclass
class _Config:
    """A candidate assignment of the optimum, with what it loads and serves."""

    placed: dict[str, Placed]
    units: list[Unit]
    parts: dict[str, frozenset[Part]]  # by model


def _config(placed: Mapping[str, Placed], models: Mapping[str, SimModel], ctx: int) -> _Config:
    units = []
    parts: dict[str, set[Part]] = {}
    for m in sorted(placed):
        for u in units_of(placed[m], models[m].cost, ctx):
            units.append(u)
            parts.setdefault(m, set()).update(u.parts)
    return _Config(dict(placed), units, {m: frozenset(v) for m, v in parts.items()})


def _key(config: _Config) -> tuple:
    return tuple(
        (
            m,
            tuple(sorted((p.peer_id, p.start, p.end) for p in config.parts[m])),
            tuple((c.peer_id, c.vram_bytes) for c in config.placed[m].peers),
        )
        for m in sorted(config.parts)
    )


def optimum(
    mesh: Sequence[SimPeer],
    models: Sequence[SimModel],
    trace: Trace,
    *,
    online: SimResult | None = None,
    window_s: float = WINDOW_S,
    context_tokens: int = CONTEXT_TOKENS,
) -> tuple[SimResult, dict[int, dict[str, Placed]]]:
    """The best schedule found with the whole trace known (see the module's docstring),
    and its run through the simulation."""
    by_id = {m.model_id: m for m in models}
    peers = {p.peer_id: p for p in mesh}
    per_window = max(1, round(window_s / trace.step_s))
    windows = math.ceil(trace.steps / per_window)
    first_files = {(p.peer_id, m) for p in mesh for m in p.holds}

    def steps_of(w: int) -> range:
        return range(w * per_window, min(trace.steps, (w + 1) * per_window))

    configs: dict[tuple, _Config] = {}

    def remember(placed: Mapping[str, Placed]) -> tuple:
        c = _config(placed, by_id, context_tokens)
        key = _key(c)
        configs.setdefault(key, c)
        return key

    generated: list[set[tuple]] = []
    for w in range(windows):
        keys: set[tuple] = set()
        ks = steps_of(w)
        level = {
            "mean": {m: sum(trace.rates[m][k] for k in ks) / len(ks) for m in sorted(trace.rates)},
            "peak": {m: max(trace.rates[m][k] for k in ks) for m in sorted(trace.rates)},
        }
        for d in level.values():
            active = [m for m in sorted(d) if d[m] > 0]
            subsets = [active] + [[x for x in active if x != m] for m in active]
            for chosen in subsets:
                for biggest in (False, True):
                    keys.add(remember(pack(mesh, by_id, d, chosen, biggest_first=biggest)))
        if online is not None:
            for k in (ks.start, (ks.start + ks.stop) // 2):
                if k < len(online.configs):
                    keys.add(remember(online.configs[k]))
        generated.append(keys)
    # Each window may take what was made for it and for the next (to load ahead of demand).
    candidates = [
        sorted(generated[w] | (generated[w + 1] if w + 1 < windows else set()))
        for w in range(windows)
    ]

    served_cache: dict[tuple[tuple, int], dict[str, float]] = {}

    def served(key: tuple, k: int) -> dict[str, float]:
        if (key, k) not in served_cache:
            served_cache[(key, k)] = serve(trace.at(k), configs[key].units)
        return served_cache[(key, k)]

    def value(key: tuple, w: int) -> float:
        return sum(sum(served(key, k).values()) for k in steps_of(w)) * trace.step_s

    loss_cache: dict[tuple, float] = {}

    def loss(prev: tuple | None, key: tuple, w: int) -> float:
        """Tokens the new parts of `key` do not serve while they load, from window `w`."""
        before = configs[prev].parts if prev is not None else {}
        after = configs[key]
        lost = 0.0
        for m in sorted(after.parts):
            old = before.get(m, frozenset())
            if old == after.parts[m]:
                continue
            memo = (m, old, key, w)
            if memo not in loss_cache:
                loss_cache[memo] = _load_loss(m, old, key, w)
            lost += loss_cache[memo]
        return lost

    def _load_loss(m: str, old: frozenset[Part], key: tuple, w: int) -> float:
        """What `m`'s parts new in `key` (not in `old`) do not serve while they load: the
        share of its tokens they carry, until the slowest of them is loaded (a peer that
        held `m` before, or its file from the start, loads from disk)."""
        after = configs[key]
        cost = by_id[m].cost
        fresh = [u for u in after.units if u.model_id == m and any(p not in old for p in u.parts)]
        if not fresh:
            return 0.0
        held = {p.peer_id for p in old}
        longest = 0.0
        for u in fresh:
            for p in u.parts:
                if p in old:
                    continue
                size = cost.weight_bytes(p.start, p.end)
                peer = peers[p.peer_id]
                t = LOAD_FIXED_S + size / peer.disk_bps
                if (p.peer_id, m) not in first_files and p.peer_id not in held:
                    t += size / peer.net_bps
                longest = max(longest, t)
        mine = [u for u in after.units if u.model_id == m]
        share = sum(u.max_rate for u in fresh) / max(sum(u.max_rate for u in mine), 1e-9)
        k0 = steps_of(w).start
        lost = 0.0
        for k in range(k0, min(trace.steps, k0 + math.ceil(longest / trace.step_s))):
            part = min(1.0, (k0 * trace.step_s + longest - k * trace.step_s) / trace.step_s)
            lost += served(key, k).get(m, 0.0) * trace.step_s * share * part
        return lost

    # For each state (the configuration followed in the window): (tokens, path of keys).
    best: dict[tuple | None, tuple[float, list[tuple]]] = {None: (0.0, [])}
    for w in range(windows):
        nxt: dict[tuple | None, tuple[float, list[tuple]]] = {}
        previous = sorted(best, key=lambda k: (k is not None, k or ()))
        for key in sorted(set(candidates[w]) | {k for k in best if k is not None}):
            v = value(key, w)
            top: tuple[float, list[tuple]] | None = None
            for prev in previous:
                total = best[prev][0] + v - (loss(prev, key, w) if prev != key else 0.0)
                if top is None or total > top[0]:
                    top = (total, [*best[prev][1], key])
            assert top is not None
            nxt[key] = top
        kept = sorted(nxt, key=lambda k: (-nxt[k][0], k or ()))[:KEEP_STATES]
        best = {k: nxt[k] for k in kept}
    path = max(best.values(), key=lambda x: x[0])[1]
    schedule = {w * per_window: configs[key].placed for w, key in enumerate(path)}
    return run_schedule(mesh, models, trace, schedule, context_tokens=context_tokens), schedule
