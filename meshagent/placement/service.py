"""The placement service of one agent: read the gossiped snapshot, agree on a plan, take part.

Each round: collect the alive peers' capacities and placement claims for the model, find the
plan in force, propose a new plan (next epoch) when the planner's plan beats it by the replan
threshold or it is broken, follow the plan in force (load this agent's part, then claim it
ready), and recompute whether the split is routable. It runs again whenever gossip changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import structlog
import trio

from meshagent.capacity import COMPUTE_UNIT, offered_memory
from meshagent.errors import MeshError
from meshagent.gossip.failure import PeerState
from meshagent.net.coordinates import Coordinate
from meshagent.placement import quorum
from meshagent.placement.negotiation import (
    Claim,
    ClaimError,
    next_epoch,
    plan_digest,
    plan_in_force,
    routable,
    serving_peers,
)
from meshagent.placement.planner import (
    ModelCost,
    PeerCapacity,
    Plan,
    PlanError,
    is_repair,
    plan,
    should_replan,
)

log = structlog.get_logger(__name__)

EXTRAS_KEY = "placement"  # this service's entry in the `extras` of a gossip record
# The models an agent takes part in (their ids), in the `extras` of its record: placement plans
# a model only on the peers that take part in it. A record without it (an agent before many
# models) takes part in every model.
TAKES_KEY = "takes"
MAX_TAKES = 64


def takes_part(record: Any, model_id: str) -> bool:
    """Whether the peer of `record` takes part in `model_id` (may be planned a part of it)."""
    takes = record.extras.get(TAKES_KEY) if isinstance(record.extras, dict) else None
    if takes is None:
        return True
    if not isinstance(takes, list) or len(takes) > MAX_TAKES:
        return False  # not a list of model ids: it takes part in none
    want = model_id.casefold()
    return any(isinstance(t, str) and t.casefold() == want for t in takes)


class Snapshot(Protocol):
    """What placement needs of gossip (meshagent.gossip.service.GossipService fits)."""

    @property
    def peer_id(self) -> str: ...

    def snapshot(self) -> Mapping[str, Any]: ...

    def update_local(self, **fields: Any) -> None: ...

    def spread_now(self) -> None:
        """Send what changed here to the other peers now, not in the next rounds."""
        ...

    async def wait_changed(self, after: int) -> int: ...

    @property
    def generation(self) -> int: ...


def capacities(
    views: Mapping[str, Any],
    flops_per_layer: float = 0.0,
    source_sha256: str = "",
    model_id: str | None = None,
) -> list[PeerCapacity]:
    """Alive peers that offer memory and have measured their speed (and, given `model_id`,
    take part in that model). A speed in GFLOP/s (the gossip unit) becomes layers per second
    of this model when `flops_per_layer` is known, so that compute time and RTTs add up in
    the same unit. With the model file's `source_sha256` known, each peer's capacity says what
    it holds of it (the file, or stage artifacts); not known, every peer counts as holding the
    file."""
    out = []
    for pid, view in views.items():
        if view.state == PeerState.DEAD:
            continue
        r = view.record
        if model_id is not None and not takes_part(r, model_id):
            continue
        memory = offered_memory(r)
        if memory <= 0 or r.compute_speed <= 0:
            continue
        per_layer = 1.0
        if flops_per_layer > 0 and getattr(r, "compute_unit", "") == COMPUTE_UNIT:
            per_layer = 1e9 / flops_per_layer
        speed = float(r.compute_speed) * per_layer
        # GPUs: their offers together, at their offer-weighted speed (0 until measured).
        offered = [(d.offer_bytes, d.speed) for d in getattr(r, "devices", ()) if d.offer_bytes]
        vram = sum(b for b, _ in offered)
        vram_speed = sum(b * s for b, s in offered) / vram * per_layer if vram else 0.0
        draft = getattr(r, "draft_gflops", (0.0, 0.0))  # GFLOP per token (`draft_ms`)
        whole, holds = True, frozenset()
        if source_sha256:
            whole = any(m.sha256 == source_sha256 for m in r.models)
            holds = frozenset(
                (a.start, a.end)
                for a in r.artifacts
                if a.source_sha256 == source_sha256 and a.kind == "layers"
            )
        out.append(
            PeerCapacity(
                pid,
                memory,
                speed,
                dict(r.rtts_ms),
                whole,
                holds,
                vram_bytes=vram if vram_speed > 0 else 0,
                vram_speed=vram_speed,
                spare_bytes=int(getattr(r, "mem_spare_bytes", 0)),
                tokenizer=source_sha256 not in getattr(r, "no_tokenizer", ()),
                coord=Coordinate.from_wire(list(r.coord)) if getattr(r, "coord", ()) else None,
                draft_gflops=draft[0],
                drafts_from_gflops=draft[1],
            )
        )
    return out


def claims_for(
    model_id: str, views: Mapping[str, Any], n_layers: int | None = None
) -> dict[str, Claim]:
    """The claims alive peers gossip for `model_id` (of `n_layers`, where given); a claim
    that does not decode is logged and left out."""
    out: dict[str, Claim] = {}
    for pid, view in views.items():
        if view.state == PeerState.DEAD:
            continue
        raw = view.record.extras.get(EXTRAS_KEY, {})
        if not isinstance(raw, dict) or model_id not in raw:
            continue
        try:
            claim = Claim.from_cbor(raw[model_id], model_id=model_id, n_layers=n_layers)
        except ClaimError as e:
            log.warning("placement.bad_claim", peer=pid, error=str(e))
            continue
        out[pid] = claim
    return out


class PlacementService:
    def __init__(
        self,
        gossip: Snapshot,
        cost: ModelCost,
        *,
        context_tokens: int,
        take_part: Callable[[Plan], Awaitable[None]],
        release: Callable[[Plan], Awaitable[None]] | None = None,
        headroom: float = 0.1,
        threshold: float = 0.25,
        tick: float = 1.0,
        settle: float = 2.0,
        repair_settle: float = 0.25,
    ) -> None:
        self.gossip = gossip
        self.cost = cost
        self.source_sha256 = ""  # the model file's, once known: who holds what of it
        self.context_tokens = context_tokens
        self._take_part = take_part  # load this agent's part of a plan (may take a while)
        # Stop serving the part of a plan no longer in force (given the plan replacing it).
        self._release = release
        self.headroom = headroom
        self.threshold = threshold
        self.tick = tick
        # A plan must stay in force this long before agents load their parts, so that rival
        # proposals made at the same moment are resolved before anyone loads the loser.
        self.settle = settle
        # A repair (the same stages, a lost peer's given to a spare) is what every agent
        # computes alike from the plan in force, so rivals are rare and it settles sooner:
        # requests wait for it.
        self.repair_settle = min(repair_settle, settle)
        self._seen_settle = settle  # the settling time of the plan `_seen` holds
        self._seen: tuple[str, float] | None = None  # (digest of the plan in force, since)
        self._failed: str | None = None  # digest of a plan this agent could not load
        self._load_error: str | None = None  # and why
        # Loading a part runs beside the decisions (a download can take minutes, and the mesh
        # may change meanwhile): one load at a time, the digest it loads, the last one done.
        self._loads: trio.Nursery | None = None  # while `run` runs
        self._loading: str | None = None
        self._loaded: str | None = None
        self._load_done = trio.Event()
        self.in_force: Claim | None = None
        self.mine: Claim | None = None
        self.routable = False
        self.ready: tuple[str, ...] = ()  # peers of the plan in force serving it now
        self.error: str | None = None  # why no plan can host the model, if none can
        self.error_since = 0.0  # trio time `error` last changed
        self.changed = trio.Event()
        self._running = trio.CancelScope()
        # Many models: the share of the mesh this model may use (`ModelHost`'s assignment),
        # given the capacities of the peers taking part in it: those cut to the model's
        # share, or why it is not placed now (then this agent stands down: its claim is
        # withdrawn and its part, once no request uses it, unloaded). None: all of it.
        self.allowance: Callable[[list[PeerCapacity]], list[PeerCapacity] | str] | None = None
        self.placed = True  # False while the allowance places the model nowhere
        # How many chains a split should have (the assignment's, by the model's demand).
        self.chains = 1
        # The peers that left or came between decisions (`quorum.py`: an agent that lost
        # more than it sees, or whose view changes in a burst, proposes nothing).
        self._turnover = quorum.Turnover()

    def _publish(self, claim: Claim) -> None:
        self.mine = claim
        views = self.gossip.snapshot()
        me = views.get(self.gossip.peer_id)
        extras = dict(me.record.extras) if me is not None else {}
        placement = dict(extras.get(EXTRAS_KEY, {}))
        placement[self.cost.model_id] = claim.to_cbor()
        extras[EXTRAS_KEY] = placement
        self.gossip.update_local(extras=extras)
        self.gossip.spread_now()  # the others wait on claims: a split routes once all are ready

    def _set_error(self, error: str | None) -> None:
        if error != self.error:
            self.error, self.error_since = error, trio.current_time()
            if error is not None:
                log.info("placement.not_served", model=self.cost.model_id, reason=error)

    async def step(self) -> None:
        """One decision on the current snapshot."""
        views = self.gossip.snapshot()
        me = self.gossip.peer_id
        caps = capacities(views, self.cost.flops_per_layer, self.source_sha256, self.cost.model_id)
        if self.allowance is not None:
            allowed = self.allowance(caps)
            if isinstance(allowed, str):
                await self._stand_down(allowed)
                return
            caps, self.placed = allowed, True
        claims = claims_for(self.cost.model_id, views, self.cost.n_layers)
        winner = plan_in_force(claims)
        alive = {pid for pid, v in views.items() if v.state != PeerState.DEAD} | {me}
        self._turnover.note(alive, trio.current_time())
        error = None
        try:
            candidate: Plan | None = plan(
                self.cost,
                caps,
                context_tokens=self.context_tokens,
                headroom=self.headroom,
                current=winner.plan if winner is not None else None,
                chains=self.chains,
            )
        except PlanError as e:
            candidate, error = None, str(e)
            if winner is not None and set(winner.plan.peers) <= alive:
                # A plan in force whose peers are all here: it is followed (loaded, then
                # served) even where this agent's view of the offers finds no plan of its own.
                log.debug("placement.no_plan_of_its_own", model=self.cost.model_id, why=error)
                error = None
        if self._failed is not None and self._seen is not None and self._failed == self._seen[0]:
            error = self._load_error
        self._set_error(error)
        wants = candidate is not None and (
            winner is None
            or (
                plan_digest(candidate) != plan_digest(winner.plan)
                and should_replan(self.cost, winner.plan, candidate, caps, threshold=self.threshold)
            )
        )
        cut = self._turnover.cut_off(len(alive), trio.current_time()) if wants else None
        if cut is not None:
            if self.error != cut:
                log.warning("placement.cut_off", model=self.cost.model_id, why=cut)
            self._set_error(cut)
        elif wants and candidate is not None:
            winner = Claim(self.cost.model_id, next_epoch(claims), me, candidate, ready=False)
            log.info("placement.propose", epoch=winner.epoch, peers=list(candidate.peers))
        now = trio.current_time()
        if winner is not None:
            digest = plan_digest(winner.plan)
            if self._seen is None or self._seen[0] != digest:
                before = self.in_force.plan if self.in_force is not None else None
                repair = before is not None and is_repair(before, winner.plan)
                self._seen_settle = self.repair_settle if repair else self.settle
                self._seen = (digest, now)
            await self._release_stale(winner)
        outside = winner is not None and me not in winner.plan.peers and winner.proposer != me
        if outside:
            # An agent outside the plan that did not propose it follows it without a claim:
            # were every agent to claim every plan, each plan change would be a record
            # republished by every agent of the mesh (at 300 agents, most of its gossip).
            self._withdraw_claim()
        elif winner is not None and not self._follows(winner):
            assert self._seen is not None
            digest, part = self._seen[0], _part_digest(winner.plan, me)
            # This agent's chain the same as the one it serves (a chain added, dropped or
            # repaired elsewhere): nothing to load or wait for, it serves on.
            kept = me in winner.plan.peers and self._loaded == part
            pending = Claim(winner.model_id, winner.epoch, winner.proposer, winner.plan, False)
            if self.mine != pending and not kept:
                self._publish(pending)
            settled = kept or now - self._seen[1] >= self._seen_settle
            if settled and self._failed != digest:
                if me not in winner.plan.peers or kept:
                    ready = Claim(winner.model_id, winner.epoch, winner.proposer, winner.plan, True)
                    self._publish(ready)
                    claims[me] = ready
                elif self._loading is None and self._loads is not None:
                    self._loading, self._loaded = part, None
                    self._loads.start_soon(self._load, digest, part, winner)
        self.in_force = winner
        was = self.routable
        self.routable = winner is not None and routable(winner, claims, alive)
        self.ready = serving_peers(winner, claims, alive) if winner is not None else ()
        if self.routable != was:
            log.info(
                "placement.routable",
                routable=self.routable,
                peers=list(winner.plan.peers) if winner else [],
            )
        self.changed.set()
        self.changed = trio.Event()

    async def _stand_down(self, why: str) -> None:
        """The model is not placed now: no claim, no plan, no part here (a load under way
        is judged when it ends)."""
        self.placed = False
        self._set_error(why)
        self._withdraw_claim()
        if self._loaded is not None and self._loading is None:
            self._loaded = None
            if self._release is not None:
                await self._release(Plan(self.cost.model_id, self.context_tokens))
        self._seen = None
        was = self.routable
        self.in_force, self.routable, self.ready = None, False, ()
        if was:
            log.info("placement.routable", routable=False, peers=[], why=why)
        self.changed.set()
        self.changed = trio.Event()

    def _withdraw_claim(self) -> None:
        """This agent's claim on the model, if it has one, leaves its record."""
        if self.mine is None:
            return
        self.mine = None
        views = self.gossip.snapshot()
        me = views.get(self.gossip.peer_id)
        extras = dict(me.record.extras) if me is not None else {}
        placement = dict(extras.get(EXTRAS_KEY, {}))
        placement.pop(self.cost.model_id, None)
        extras[EXTRAS_KEY] = placement
        self.gossip.update_local(extras=extras)
        self.gossip.spread_now()

    async def _release_stale(self, winner: Claim) -> None:
        """The part loaded here (served, or loaded for a plan replaced meanwhile) is not of
        `winner`'s plan: stop serving it now, not after the settling time (its peers may be
        gone). Never while a load runs: that one is judged when it ends."""
        mine = _part_digest(winner.plan, self.gossip.peer_id)
        if self._loaded in (None, mine) or self._loading is not None:
            return
        self._loaded = None
        if self._release is not None:
            await self._release(winner.plan)

    async def _load(self, digest: str, part: str, winner: Claim) -> None:
        """Load this agent's part of `winner`'s plan. Decisions go on meanwhile: the plan is
        claimed ready by the next one if it is still in force then; if another replaced it,
        that one is loaded next (a repair that keeps this agent's part loads nothing)."""
        try:
            await self._take_part(winner.plan)
        except MeshError as e:
            # This agent cannot load its part: it stays out of the plan (never claims it
            # ready) instead of exiting; a later plan is tried afresh.
            self._failed = digest
            self._load_error = f"could not load this agent's part of the plan: {e}"
            log.error("placement.take_part_failed", epoch=winner.epoch, error=str(e))
        else:
            self._loaded = part
        finally:
            self._loading = None
            self._load_done.set()
            self._load_done = trio.Event()

    def _next_wake(self) -> float:
        """Seconds until the next decision is due even without a gossip change."""
        if self._seen is not None and not (self.mine is not None and self.mine.ready):
            waited = trio.current_time() - self._seen[1]
            if waited < self._seen_settle:
                return min(self.tick, max(self._seen_settle - waited, 0.01))
        return self.tick

    def _follows(self, winner: Claim) -> bool:
        m = self.mine
        return (
            m is not None
            and m.ready
            and m.epoch == winner.epoch
            and plan_digest(m.plan) == plan_digest(winner.plan)
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with self._running:
            async with trio.open_nursery() as loads:
                self._loads = loads
                try:
                    await self._decide()
                finally:
                    self._loads = None

    async def _decide(self) -> None:
        """A decision on every gossip change, load done, and `_next_wake`."""
        while True:
            seen = self.gossip.generation
            await self.step()
            with trio.move_on_after(self._next_wake()):
                await self._changed(seen, self._load_done)

    async def _changed(self, seen: int, load_done: trio.Event) -> None:
        """Returns when gossip moves past generation `seen` or `load_done` is set."""
        async with trio.open_nursery() as race:

            async def gossip_changed() -> None:
                await self.gossip.wait_changed(seen)
                race.cancel_scope.cancel()

            async def loaded() -> None:
                await load_done.wait()
                race.cancel_scope.cancel()

            race.start_soon(gossip_changed)
            race.start_soon(loaded)

    def stop(self) -> None:
        """This agent is leaving: it proposes no plan and takes no part from now on (what it
        serves keeps serving until it closes)."""
        self._running.cancel()


def _part_digest(plan: Plan, peer_id: str) -> str:
    """What this agent loads of `plan`: the digest of its chain (the plan itself where it
    has one chain), so that a plan changing only other chains leaves its part as it is."""
    return plan_digest(plan.chain_of(peer_id))
