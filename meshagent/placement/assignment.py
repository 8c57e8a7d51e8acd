"""The assignment: which peers each model of the catalogue may use, and how much of each
peer's memory, from the peers' offers and the mesh's demand.

A pure, deterministic function of a snapshot, like the planner: every agent that sees the
same offers, demand and current placement computes the same assignment (peers sorted by id,
models by id, every loop in a fixed order, rates from integers added in a fixed order). Each
model placed gets its peers as `PeerCapacity` values cut to its share of their memory, ready
for `plan()`; one `PlacementService` per model plans over those (`restrict` cuts the
service's own capacities of the model the same way).

Rules, in the order they run (docs/placement.md, "Many models: the assignment"):
1. Wanted: the pinned models, and those with a request in flight or whose keep_alive has not
   run out (`Demand.wanted`). The others are not placed, with the reason.
2. Priority: pinned first, then those a request waits for now (in flight), then tokens per
   second over the window (`WINDOW_S`), then requests per second, then model id. A model
   only kept alive thus gives way to one asked for now, least recently used first, as
   ollama unloads an idle model for the one a request needs.
3. Keep (hysteresis): a model placed now keeps its peers while it is wanted, they take part
   in it and still hold it.
4. Shrink: replicas go only once a model's demand has settled (the recent and the whole
   window within `SETTLED` of each other) and the others would serve it at under
   `SHRINK_AT` of what they can; then in one go, down to as few as serve it under `GROW_TO`.
5. Place the others in priority order on free memory: whole on the peer where it would be
   served fastest (a peer's speed counted for the share of its compute the models already
   there leave, `_room`), or near it (`CLOSE`) on one that served it or holds its file;
   split over several peers (the planner's split) only when no peer could hold it whole even
   with nothing else loaded. When there is no room: other models' extra replicas give way
   first, then lower-priority models that are not pinned, least recently used first; what
   turns out not to be in the way is put back. Only a pinned model or one a request waits
   for moves others aside: one only kept alive comes back on free memory alone. A model
   that would fit the mesh alone but finds the memory held by models of higher priority is
   `crowded`: its requests wait for them to go idle (`Assigning.may_yet_place`), they do
   not fail.
6. Grow: a model served whole whose recent demand (`SHORT_S`) passes `GROW_AT` of what its
   replicas serve gets replicas on free memory, in one go, until they would serve it at
   under `GROW_TO`, each one adding at least `MIN_REPLICA` of what they serve alone. Never
   by eviction; another model's spare replica gives way where it is `RECLAIM` times better
   than the best free peer (`_best_peer`).
7. Fill: a pinned model served whole stays loaded on every peer taking part in it that can
   still hold it whole (`_fill`); these replicas give way first.

What each model costs where, what it asks of its peers' compute and the free memory left are
the ledger's (`ledger.py`); finding room for a model on free memory is `room.py`'s; the rules
for a split's chains are `chain_rules.py`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from meshagent.placement.chain_rules import SplitChains
from meshagent.placement.costs import streams_gain
from meshagent.placement.demand import BUCKET_S, NEVER, SHORT_S, WINDOW_S, Demand
from meshagent.placement.ledger import Ledger
from meshagent.placement.negotiation import plan_digest
from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    Plan,
    PlanError,
    estimated_token_ms,
    plan,
    should_replan,
)
from meshagent.placement.room import Room
from meshagent.placement.shares import Free, Placing, Share
from meshagent.placement.thresholds import (
    GROW_AT,
    GROW_TO,
    MIN_REPLICA,
    SETTLED,
    SHRINK_AT,
)

NO_DEMAND = Demand()
_CHAIN = "\0chain"  # a victim that is a split's last chain (`_victims`), not a peer


@dataclass(frozen=True)
class Placed:
    """One model's peers, their memory cut to its share, and the plan on them."""

    model_id: str
    # By peer id. Memory, VRAM and spare are this model's share of the peer's offer; speeds
    # are in layers per second of this model.
    peers: tuple[PeerCapacity, ...]
    plan: Plan
    tokens_per_s: float  # what the plan serves alone, each replica or chain with its streams

    @property
    def chains(self) -> int:
        """How many chains the split has (1 for a model served whole)."""
        return max(1, len(self.plan.pipelines))

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(p.peer_id for p in self.peers)

    def share(self, peer_id: str) -> PeerCapacity | None:
        return next((p for p in self.peers if p.peer_id == peer_id), None)


@dataclass(frozen=True)
class Assignment:
    """Each catalogued model placed (with its peers and plan) or not (with the reason)."""

    placed: tuple[Placed, ...] = ()  # by model id
    not_placed: tuple[tuple[str, str], ...] = ()  # (model id, why), by model id
    # Asked for now, not placed for memory that models of higher priority hold (each would
    # fit alone): its requests wait for those to go idle.
    crowded: tuple[str, ...] = ()

    def get(self, model_id: str) -> Placed | None:
        return next((p for p in self.placed if p.model_id == model_id), None)

    def reason(self, model_id: str) -> str | None:
        return next((why for m, why in self.not_placed if m == model_id), None)

    def plans(self) -> dict[str, Plan]:
        """Each placed model's plan: what to pass as `current` next time."""
        return {p.model_id: p.plan for p in self.placed}


def restrict(placed: Placed, caps: Sequence[PeerCapacity]) -> list[PeerCapacity]:
    """`caps` (as `service.capacities` gives them for this model) of the model's peers only,
    each cut to the model's share of its memory; sorted by peer id."""
    out = []
    for cap in sorted(caps, key=lambda c: c.peer_id):
        share = placed.share(cap.peer_id)
        if share is not None:
            out.append(
                replace(
                    cap,
                    memory_bytes=share.memory_bytes,
                    vram_bytes=share.vram_bytes,
                    spare_bytes=share.spare_bytes,
                )
            )
    return out


def assign(
    models: Mapping[str, ModelCost],
    peers: Sequence[PeerCapacity],
    demand: Mapping[str, Demand],
    *,
    now: float,
    context_tokens: int,
    headroom: float = 0.1,
    pins: frozenset[str] = frozenset(),
    current: Mapping[str, Plan] | None = None,
    holders: Mapping[str, frozenset[str]] | None = None,
    eligible: Mapping[str, frozenset[str]] | None = None,
    chains: Mapping[str, int] | None = None,
    streams: int = 1,
) -> Assignment:
    """The assignment of `peers` to `models` (by id) for the mesh's `demand` at `now`.
    `peers`' speeds are in GFLOP/s (the gossiped unit), turned into layers per second of
    each model by its `flops_per_layer` (taken as layers per second where that is 0).
    `current`: each model's plan in force (what the mesh serves now). `holders`: the peers
    holding each model's file, preferred (None: every peer holds every file). `eligible`:
    the peers that may take part in each model at all (None: every peer; a model missing:
    none). `chains`: the chains a pinned split keeps at least, where free memory holds
    them (`--chains`; more as demand asks). `streams`: the sequences a replica or a chain
    decodes together (the agents' `--slots`); what each serves counts them
    (`costs.streams_gain`), and `demand` is in decoded tokens (`costs.decode_work`)."""
    return _Assigner(
        models,
        peers,
        demand,
        now,
        context_tokens,
        headroom,
        pins,
        current or {},
        holders,
        eligible,
        chains or {},
        streams,
    ).run()


@dataclass(frozen=True)
class _Rates:
    window: float  # tokens per second over `WINDOW_S`
    recent: float  # over `SHORT_S`
    latest: float  # over the last `BUCKET_S`
    peak: float  # the busiest bucket of the window
    requests: float  # requests per second over `WINDOW_S`


class _Assigner(Ledger, Room, SplitChains):
    def __init__(
        self,
        models: Mapping[str, ModelCost],
        peers: Sequence[PeerCapacity],
        demand: Mapping[str, Demand],
        now: float,
        context_tokens: int,
        headroom: float,
        pins: frozenset[str],
        current: Mapping[str, Plan],
        holders: Mapping[str, frozenset[str]] | None,
        eligible: Mapping[str, frozenset[str]] | None,
        chains: Mapping[str, int],
        streams: int,
    ) -> None:
        self.gain = streams_gain(streams)
        self.models = {m: models[m] for m in sorted(models)}
        self.least_chains = {m: n for m, n in chains.items() if m in pins}
        self.peers = sorted(peers, key=lambda p: p.peer_id)
        self.by_id = {p.peer_id: p for p in self.peers}
        self.now = now
        self.ctx = context_tokens
        self.headroom = headroom
        self.pins = pins
        self.current = current
        self.holders = holders
        self.eligible = eligible
        self.free = {
            p.peer_id: Free(p.memory_bytes, p.vram_bytes, p.spare_bytes) for p in self.peers
        }
        self.demand = {m: demand.get(m, NO_DEMAND) for m in self.models}
        self.rates = {
            m: _Rates(
                d.tokens_per_s(now, WINDOW_S),
                d.tokens_per_s(now, SHORT_S),
                d.tokens_per_s(now, BUCKET_S),
                d.peak_per_s(now, WINDOW_S),
                d.requests_per_s(now, WINDOW_S),
            )
            for m, d in self.demand.items()
        }
        self.placing: dict[str, Placing] = {}
        self.reasons: dict[str, str] = {}
        self.crowded: set[str] = set()
        self._scaled: dict[tuple[str, str], PeerCapacity] = {}
        self._ms: dict[tuple[str, str, Share], float] = {}
        self._whole: dict[str, bool] = {}
        self._shares: dict[tuple[str, int, int, int], Share | None] = {}
        self._changes = 0  # of the ledger: what `_use` computed before may be stale
        self._uses: dict[str, tuple[int, dict[str, float]]] = {}

    # The steps.

    def run(self) -> Assignment:
        wanted = [m for m in self.models if m in self.pins or self.demand[m].wanted(self.now)]
        for m in self.models:
            if m not in wanted:
                self.reasons[m] = self._idle(m)
        order = sorted(wanted, key=self._priority)
        for m in order:
            self._keep(m)
        for m in order:
            if m in self.placing:
                if self.placing[m].split:
                    self._shrink_chains(m)
                else:
                    self._shrink(m)
        for m in order:
            if m not in self.placing:
                self._place(m, order)
        for m in order:
            if m in self.placing:
                if self.placing[m].split:
                    self._grow_chains(m)
                else:
                    self._grow(m)
        for m in order:
            if m in self.pins and m in self.placing and not self.placing[m].split:
                self._fill(m)
        return self._result()

    def _priority(self, m: str) -> tuple[bool, bool, float, float, str]:
        r = self.rates[m]
        return (m not in self.pins, self.demand[m].in_flight == 0, -r.window, -r.requests, m)

    def _idle(self, m: str) -> str:
        d = self.demand[m]
        if d.last_used <= 0:
            return "not requested in the last 10 minutes and not pinned"
        used = _ago(self.now - d.last_used)
        if d.expires_at <= d.last_used:
            return f"unloaded after its last request {used} ago (keep_alive 0)"
        keep = _ago(d.expires_at - d.last_used)
        return f"idle since {used} ago (keep_alive {keep})"

    def _keep(self, m: str) -> None:
        """Keep what `m` is served on now, where those peers still hold it. A split that
        lost a stage, or a model that lost every replica, is placed afresh after."""
        cur = self.current.get(m)
        if cur is None:
            return
        allowed = {p.peer_id for p in self._peers_for(m)}
        if not cur.split:
            kept = {}
            for pid in sorted(cur.replicas):
                f = self.free.get(pid) if pid in allowed else None
                share = self._whole_share(m, f) if f is not None else None
                if share is not None:
                    kept[pid] = share
            if kept:
                self._hold(m, Placing(False, kept))
            return
        if self._fits_one_peer(m):
            return  # a peer that holds it whole came: placed afresh, whole
        # A chain that lost a stage is repaired in its place where spares hold that stage's
        # room (the quickest way back, as for one chain), else it goes (`_grow_chains` may
        # add one); the chains that work stay as they are.
        placing = Placing(True, {})
        held = frozenset(s.peer_id for c in cur.pipelines for s in c)
        for chain in cur.pipelines:
            kept = self._intact_chain(m, chain, allowed)
            if kept is None:
                if not cur.chains:
                    return  # the one chain lost a stage: placed afresh (repaired) after
                kept = self._repair_chain(m, chain, held)
                if kept is None:
                    continue
            shares, rate, stages = kept
            for pid in sorted(shares):
                self._take(pid, shares[pid])
            placing.add_chain(shares, rate, stages)
            held |= frozenset(shares)
        if placing.chains:
            self.placing[m] = placing
            self.reasons.pop(m, None)

    def _settled(self, m: str) -> float | None:
        """`m`'s busiest demand rate once its demand has settled (the recent and the whole
        window within `SETTLED` of each other), else None: nothing shrinks before."""
        r = self.rates[m]
        busiest = max(r.recent, r.window)
        return None if abs(r.recent - r.window) > SETTLED * busiest else busiest

    def _shrink(self, m: str) -> None:
        """Fewer replicas once demand has settled well below what they serve: all the
        replicas that can go, in one go."""
        busiest = self._settled(m)
        if busiest is None:
            return
        placing = self.placing[m]
        limit = SHRINK_AT
        while len(placing.shares) > 1:
            # The one serving least goes first (then one not holding the file, then by id).
            pid = min(
                placing.shares,
                key=lambda p: (
                    self._serves_on(m, p, placing.shares[p]),
                    self._replica_rate(m, p, placing.shares[p]),
                    self._scale(m, p).whole_file,
                    p,
                ),
            )
            rest = {p: s for p, s in placing.shares.items() if p != pid}
            if busiest > limit * self._serves(m, rest):
                return
            self._give(pid, placing.shares.pop(pid))
            limit = GROW_TO

    def _place(self, m: str, order: list[str]) -> None:
        """Room for `m`, on free memory or made by moving others aside."""
        placing, why = self._fit(m)
        if placing is not None:
            self._hold(m, placing)
            return
        said = None if self._fits_one_peer(m) else self._planner_says(m)
        if said is not None:  # it fits nowhere, even with nothing else loaded
            self.reasons[m] = said
            return
        if m not in self.pins and not self.demand[m].in_flight:
            # Only kept alive (no request waits for it): it comes back on free memory, never
            # by moving another aside (two models would take turns on every request).
            self.reasons.setdefault(m, self._crowded(m, why))
            return
        moved: list[tuple[str, Placing]] = []
        for victim, pid in self._victims(m, order):
            if victim not in self.placing:
                continue
            if pid is None:
                moved.append((victim, self._drop(victim)))
            elif pid == _CHAIN:
                moved.append((victim, self._drop_chain(victim)))
            else:
                v = self.placing[victim]
                share = v.shares.pop(pid)
                self._give(pid, share)
                moved.append((victim, Placing(False, {pid: share})))
            placing, _ = self._fit(m)
            if placing is not None:
                self._hold(m, placing)
                break
        # Put back what was not in the way (all of it if nothing made room).
        for victim, was in reversed(moved):
            if self._fits_shares(was.shares):
                if victim in self.placing:
                    for pid in sorted(was.shares):
                        self._take(pid, was.shares[pid])
                    back = self.placing[victim]
                    if was.split:  # a chain, back at the end
                        back.add_chain(was.shares, was.split_rate, was.chains[0].stages)
                    else:
                        back.shares.update(was.shares)
                else:
                    self._hold(victim, was)
            elif victim not in self.placing:
                used = _ago(self.now - self.demand[victim].last_used)
                waits = self.demand[m].in_flight and not self.demand[victim].in_flight
                self.reasons[victim] = (
                    f"evicted for {m}, "
                    + ("which a request waits for" if waits else "which is in more demand")
                    + f": the least recently used model (last used {used} ago)"
                )
        if m not in self.placing:  # (an eviction's reason stays: it says more)
            self.reasons.setdefault(m, self._crowded(m, why))
            if self.demand[m].in_flight:
                self.crowded.add(m)

    def _victims(self, m: str, order: list[str]) -> list[tuple[str, str | None]]:
        """What may give way to `m`, in turn: (model, peer) for an extra replica of any
        model, (model, `_CHAIN`) for a split's last chain of several (the lowest priority's
        first, the replica serving least first); (model, None) for a model of lower priority
        than `m` and not pinned, least recently used first."""
        rank = {x: i for i, x in enumerate(order)}
        out: list[tuple[str, str | None]] = []
        for x in sorted(self.placing, key=lambda x: (-rank[x], x)):
            placing = self.placing[x]
            if placing.split:
                out += [(x, _CHAIN)] * (len(placing.chains) - 1)
                continue
            if len(placing.shares) < 2:
                continue
            by_rate = sorted(
                placing.shares,
                key=lambda p: (self._replica_rate(x, p, placing.shares[p]), p),
            )
            out += [(x, p) for p in by_rate[:-1]]
        lower = [x for x in sorted(self.placing) if rank[x] > rank[m] and x not in self.pins]
        lower.sort(key=lambda x: (self.demand[x].last_used, -rank[x], x))
        out += [(x, None) for x in lower]
        return out

    def _crowded(self, m: str, why: str | None) -> str:
        if why is not None and not self._fits_one_peer(m):
            return why
        return self._no_room(m) + " (the rest holds models in more demand, or pinned)"

    def _grow(self, m: str) -> None:
        """More replicas when recent demand passes `GROW_AT` of what they serve: as many as
        it takes, in one go."""
        r = self.rates[m]
        placing = self.placing[m]
        serves = self._serves(m, placing.shares)
        if r.recent <= GROW_AT * serves:
            return
        target = max(r.recent, r.latest, r.peak)
        alone = 0.0
        for pid in sorted(placing.shares):
            alone += self._replica_rate(m, pid, placing.shares[pid])
        while target > GROW_TO * serves:
            best = self._best_peer(m, MIN_REPLICA * alone)
            if best is None:
                return
            pid, share, rate = best
            self._take(pid, share)
            placing.shares[pid] = share
            serves += rate

    def _fill(self, m: str) -> None:
        """A pinned model served whole stays loaded on every peer taking part in it that
        can hold it whole besides what is placed already (as `--model` always kept it): the
        memory is free, and these replicas are the first to give way (`_place`)."""
        placing = self.placing[m]
        for p in self._peers_for(m):
            if p.peer_id not in placing.shares:
                share = self._whole_share(m, self.free[p.peer_id])
                if share is not None:
                    self._take(p.peer_id, share)
                    placing.shares[p.peer_id] = share

    def _result(self) -> Assignment:
        placed = []
        for m in sorted(self.placing):
            placing = self.placing[m]
            cut = [self._cut(m, pid, placing.shares[pid]) for pid in sorted(placing.shares)]
            if len(placing.chains) > 1:
                p, rate = self._chains_plan(m, placing), placing.split_rate
            else:
                found = self._plan_on(m, cut)
                if found is None:
                    continue
                p, rate = found
            placed.append(Placed(m, tuple(cut), p, rate))
        crowded = tuple(sorted(m for m in self.crowded if m not in self.placing))
        return Assignment(tuple(placed), tuple(sorted(self.reasons.items())), crowded)

    def _plan_on(self, m: str, cut: list[PeerCapacity]) -> tuple[Plan, float] | None:
        """The planner's plan for `m` on its shares (`cut`), and what it serves; the plan in
        force where the service would keep it (`should_replan`): a split kept on exactly its
        stages' bytes, or one not enough slower to move. None (and why, in the reasons)
        where none fits, which is not expected: every share was cut to fit."""
        model = self.models[m]
        by_id = {c.peer_id: c for c in cut}
        cur = self.current.get(m)
        why = ""
        try:
            p: Plan | None = plan(
                model, cut, context_tokens=self.ctx, headroom=self.headroom, current=cur
            )
        except PlanError as e:
            p, why = None, str(e)
        works = cur is not None and estimated_token_ms(model, cur, by_id, self.ctx) is not None
        if (
            works
            and cur is not None
            and (p is None or plan_digest(p) != plan_digest(cur))
            and (p is None or not should_replan(model, cur, p, cut))
        ):
            p = cur
        if p is None:
            self.reasons[m] = why
            return None
        rate = 0.0
        if p.split:
            for chain in p.pipelines:
                one = Plan(m, self.ctx, stages=chain, est_token_ms=p.est_token_ms)
                rate += self._per_s(
                    estimated_token_ms(model, one, by_id, self.ctx) or p.est_token_ms
                )
        else:
            for pid in sorted(p.replicas):
                rate += self._per_s(by_id[pid].stage_ms(model, 0, model.n_layers, self.ctx))
        return p, rate


def _ago(seconds: float) -> str:
    """A duration as people read it: 45s, 7m12s, 2h05m."""
    if seconds == NEVER or not math.isfinite(seconds):
        return "ever"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
