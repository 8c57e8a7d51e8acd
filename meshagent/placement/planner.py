"""The planner: a pure function from a snapshot of peer capacities to a plan.

Every agent computes the plan from the gossiped snapshot on its own; the function is
deterministic (peers sorted by id, fixed evaluation order, ties broken by peer id), so agents
that see the same snapshot agree without a master.

Rules: a model that fits one peer (weights + KV cache for the plan's context + llama.cpp's
compute buffer + headroom) is served whole, by every peer it fits. Otherwise it is split: the
split with the smallest estimated time per token (compute of every stage + one trip around the
ring of measured RTTs) that the search over the whole mesh finds (`search.py`), each order cut
exactly (`cuts.py`).

A peer with GPUs offers their memory too (`vram_bytes`): a stage's layers go on the device
first and the rest in system memory (llama.cpp's per-layer offload), each part computed at
its own measured speed; the exact cut counts it stage by stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from meshagent.errors import MeshError
from meshagent.placement.costs import (
    ModelCost,
    PeerCapacity,
    StageAssignment,
    ring_ms,
    unknown_rtt,
    usable,
)
from meshagent.placement.search import MAX_STAGES, Search
from meshagent.wording import size

# A new split keeps the current one's entry unless another entry is this much faster: the
# entry holds the clients' requests, and a request whose entry moves starts its prefill again.
KEEP_ENTRY = 0.25
# Among splits this close to the fastest, the one whose peers must download the fewest bytes
# first wins (peers holding the file or the very slices load at once).
CLOSE_PLANS = 0.10


class PlanError(MeshError):
    """No plan can host the model; the message says what is missing."""


@dataclass(frozen=True)
class Plan:
    model_id: str
    context_tokens: int
    replicas: tuple[str, ...] = ()  # whole-model hosts, fastest first
    stages: tuple[StageAssignment, ...] = ()  # a split, in pipeline order (its first chain)
    est_token_ms: float = 0.0  # of the first chain, for a split
    # A split's further chains: each the whole model again over other peers, in pipeline
    # order, serving requests on its own (throughput, as a whole model's replicas).
    chains: tuple[tuple[StageAssignment, ...], ...] = ()

    @property
    def split(self) -> bool:
        return bool(self.stages)

    @property
    def pipelines(self) -> tuple[tuple[StageAssignment, ...], ...]:
        """A split's chains, the first one first; () for a model served whole."""
        return (self.stages, *self.chains) if self.stages else ()

    @property
    def peers(self) -> tuple[str, ...]:
        if not self.stages:
            return self.replicas
        return tuple(s.peer_id for chain in self.pipelines for s in chain)

    def chain_of(self, peer_id: str) -> Plan:
        """The plan as one of its peers serves it: a split cut down to the chain holding
        `peer_id` (its stages, its neighbours); the plan itself otherwise."""
        for chain in self.chains:
            if any(s.peer_id == peer_id for s in chain):
                return replace(self, stages=chain, chains=())
        return replace(self, chains=()) if self.chains else self


# A plan change must save at least this much per token (see `should_replan`).
MIN_GAIN_MS = 5.0
# A working split's entry moves only for a plan at least this much faster (1.0: twice as
# fast): the entry holds the clients' requests, which are prefilled again when it moves.
MOVE_ENTRY_GAIN = 1.0


def offloaded_layers(
    model: ModelCost, start: int, end: int, context_tokens: int, vram_bytes: int
) -> int:
    """How many of layers [start, end) llama.cpp should put on this agent's devices, given
    `vram_bytes` offered there (its `n_gpu_layers`: the last ones of the stage). One more than
    the stage's layers when everything fits, which offloads its output head too; else the
    layers' compute buffer (the head's logits stay on the CPU with the head), then each
    layer's weights and KV cache from the stage's end."""
    if vram_bytes <= 0:
        return 0
    if model.stage_bytes(start, end, context_tokens) <= vram_bytes:
        return end - start + 1
    room = vram_bytes - model.compute_bytes(last=False)
    kv = model.kv_bytes_per_token_per_layer * context_tokens
    n = 0
    for i in range(end - 1, start - 1, -1):
        room -= model.layer_bytes[i] + kv
        if room < 0:
            break
        n += 1
    return n


def plan(
    model: ModelCost,
    peers: Sequence[PeerCapacity],
    *,
    context_tokens: int,
    headroom: float = 0.1,
    current: Plan | None = None,
    chains: int = 1,
) -> Plan:
    """The plan for `model` on `peers`; raises PlanError naming what is missing. A split
    `current` plan that lost peers is repaired when it can be (`repair`); otherwise a new
    split keeps its entry unless another is faster by more than `KEEP_ENTRY`. `chains`: how
    many chains a split should have, each over peers of its own (`_chains`); fewer where
    the peers do not hold more."""
    if chains > 1 or (current is not None and current.chains):
        return _chains(model, peers, context_tokens, headroom, current, chains)
    return _plan(model, peers, context_tokens, headroom, current)


def _chains(
    model: ModelCost,
    peers: Sequence[PeerCapacity],
    context_tokens: int,
    headroom: float,
    current: Plan | None,
    chains: int,
) -> Plan:
    """A split of several chains (or fewer, or a whole model where a peer holds it). The
    chains of `current` that still work stay exactly as they are (they serve while the
    others change), the first ones where fewer are wanted; then those that lost a peer are
    repaired from peers in no chain where they can be, else dropped; the chains kept stay in
    their order. Then new chains are planned, each over the peers no chain holds, while
    they fit and fewer than `chains` are planned."""
    ordered = sorted(peers, key=lambda p: p.peer_id)
    by_id = {p.peer_id: p for p in ordered}
    pipes = current.pipelines if current is not None else ()
    held = {s.peer_id for chain in pipes for s in chain}
    want = max(1, chains)
    found: dict[int, tuple[tuple[StageAssignment, ...], float]] = {}
    used: set[str] = set()
    broken = []
    for i, chain in enumerate(pipes):
        est = estimated_token_ms(model, Plan(model.model_id, context_tokens, stages=chain), by_id,
                                 context_tokens)  # fmt: skip
        if est is None:  # lost a peer, or a part no longer fits
            broken.append(i)
        elif len(found) < want:
            found[i] = (chain, est)
            used |= {s.peer_id for s in chain}
    for i in broken:
        if len(found) >= want:
            break
        chain = pipes[i]
        mine = {s.peer_id for s in chain}
        pool = [
            p
            for p in ordered
            if p.peer_id not in used and (p.peer_id in mine or p.peer_id not in held)
        ]
        fixed = repair(model, Plan(model.model_id, context_tokens, stages=chain), pool,
                       headroom=headroom)  # fmt: skip
        if fixed is not None:
            found[i] = (fixed.stages, fixed.est_token_ms)
            held |= set(fixed.peers)
            used |= set(fixed.peers)
    kept = [found[i][0] for i in sorted(found)]
    ms = [found[i][1] for i in sorted(found)]
    while len(kept) < chains or not kept:
        rest = [p for p in ordered if p.peer_id not in used]
        if not rest and kept:
            break
        try:
            new = _plan(model, rest, context_tokens, headroom, None)
        except PlanError:
            if kept:
                break
            raise
        if not new.split:
            if kept:
                break
            return new  # a peer holds it whole: replicas, as a plan of one chain would be
        kept.append(new.stages)
        ms.append(new.est_token_ms)
        used |= set(new.peers)
    return Plan(
        model.model_id, context_tokens, stages=kept[0], est_token_ms=ms[0], chains=tuple(kept[1:])
    )


def _plan(
    model: ModelCost,
    peers: Sequence[PeerCapacity],
    context_tokens: int,
    headroom: float,
    current: Plan | None,
) -> Plan:
    if not peers:
        raise PlanError(f"no peer can host {model.model_id}: the mesh is empty")
    ordered = sorted(peers, key=lambda p: p.peer_id)
    whole = model.stage_bytes(0, model.n_layers, context_tokens)
    n = model.n_layers
    fits = [p for p in ordered if usable(p, headroom) >= p.needs(model, 0, n, context_tokens)]
    if fits:
        fits.sort(key=lambda p: (p.stage_ms(model, 0, n, context_tokens), p.peer_id))
        return Plan(
            model.model_id,
            context_tokens,
            replicas=tuple(p.peer_id for p in fits),
            est_token_ms=fits[0].stage_ms(model, 0, n, context_tokens),
        )
    if model.split_refusal is not None:
        most = max(usable(p, headroom) for p in ordered)
        raise PlanError(
            f"{model.model_id} cannot be split ({model.split_refusal}) and no peer can hold it "
            f"whole: it needs {size(whole)} on one peer, the largest offer is "
            f"{size(most)}"
        )
    if current is not None and current.split:
        repaired = repair(model, current, ordered, headroom=headroom)
        if repaired is not None:
            return repaired

    search = Search(
        model, ordered, context_tokens=context_tokens, headroom=headroom,
        unknown_rtt=unknown_rtt(ordered),
    )  # fmt: skip
    options = search.options()
    if options:
        best = _least_download(options)
        entry = current.stages[0].peer_id if current is not None and current.split else None
        kept = [o for o in options if o[1][0] == entry]
        if kept:
            keep = _least_download(kept)
            if keep[0] <= best[0] * (1.0 + KEEP_ENTRY):
                best = keep
        return Plan(model.model_id, context_tokens, stages=best[2], est_token_ms=best[0])
    spare = max(p.spare_bytes for p in ordered)
    base = whole - min(model.compute_bytes(True), spare)
    per_stage = model.other_bytes + max(0, model.compute_bytes(False) - spare)
    roomy = sorted((usable(p, headroom) for p in ordered), reverse=True)
    # the fewest stages whose memory could hold the model, the roomiest peers first
    k = next(
        (i for i in range(2, len(roomy) + 1) if sum(roomy[:i]) >= base + (i - 1) * per_stage),
        None,
    )
    what = f"weights, KV cache for {context_tokens} tokens and compute buffers"
    if k is None:
        k = min(len(roomy), MAX_STAGES)
        need, total = base + (k - 1) * per_stage, sum(roomy)
        raise PlanError(
            f"{model.model_id} needs {size(need)} across the mesh ({what}), the mesh "
            f"offers {size(total)}: it needs {size(need - total)} more memory"
        )
    if k > MAX_STAGES:
        raise PlanError(
            f"{model.model_id} needs at least {k} stages on these peers (the roomiest first) "
            f"and a split has at most {MAX_STAGES}: give the peers more memory, or add peers "
            "with more"
        )
    need, total = base + (k - 1) * per_stage, sum(roomy[:k])
    last = min(p.needs(model, n - 1, n, context_tokens) for p in ordered)
    most = max(usable(p, headroom) for p in ordered)
    if last > most:  # enough in all, but no peer can take the last stage even of one layer
        raise PlanError(
            f"{model.model_id}'s last stage needs at least {size(last)} on one peer "
            f"(its output head, {what}), the largest offer is {size(most)}: give one "
            "peer more memory"
        )
    # Enough in all by the sum, but the layers do not fall into the offers as they are.
    raise PlanError(
        f"no split of {model.model_id} fits: over its {k} roomiest peers it needs about "
        f"{size(need)} ({what}), they offer {size(total)}, the largest "
        f"{size(most)}: give the peers more memory"
    )


# (est. ms per token, peer order, stages, bytes its peers must download first)
_Option = tuple[float, tuple[str, ...], tuple[StageAssignment, ...], int]


def _least_download(options: Sequence[_Option]) -> _Option:
    """The fastest option, unless one within `CLOSE_PLANS` of it, of no more stages, downloads
    fewer bytes: then the one of those that downloads least (ties: the faster, then by peer
    ids). A peer that holds the file takes a stage a downloading peer would have had, not one
    more stage."""
    fastest = min(options, key=lambda o: (o[0], o[1]))
    close = [
        o
        for o in options
        if o[0] <= fastest[0] * (1.0 + CLOSE_PLANS) and len(o[2]) <= len(fastest[2])
    ]
    return min(close, key=lambda o: (o[3], o[0], o[1]))


def is_repair(before: Plan, after: Plan) -> bool:
    """`after` is `before` with some stages' peers replaced and nothing else changed (the
    same chains, each with the same layers)."""
    if not (before.split and after.split) or len(before.pipelines) != len(after.pipelines):
        return False
    if any(len(a) != len(b) for a, b in zip(before.pipelines, after.pipelines, strict=True)):
        return False
    pairs = [
        (a, b)
        for x, y in zip(before.pipelines, after.pipelines, strict=True)
        for a, b in zip(x, y, strict=True)
    ]
    same_layers = all((a.start, a.end) == (b.start, b.end) for a, b in pairs)
    return same_layers and any(a.peer_id != b.peer_id for a, b in pairs)


def repair(
    model: ModelCost, current: Plan, peers: Sequence[PeerCapacity], *, headroom: float = 0.1
) -> Plan | None:
    """`current` with each of its stages whose peer is gone (not among `peers`) given to a
    peer outside the plan that can hold that same stage, fastest first; None when no stage is
    missing or one cannot be placed so. The stages that stay keep their layers, so their
    agents keep what they loaded, and only the newcomers load: the quickest way back to a
    routable split after a loss."""
    live = {p.peer_id: p for p in peers}
    if all(s.peer_id in live for s in current.stages):
        return None
    ctx = current.context_tokens
    for s in current.stages:
        p = live.get(s.peer_id)
        if p is not None and usable(p, headroom) < p.needs(model, s.start, s.end, ctx):
            return None  # a stage that stays no longer fits its peer: not a repair's case
    spares = sorted(
        (p for p in peers if p.peer_id not in current.peers), key=lambda p: (-p.speed, p.peer_id)
    )
    stages = []
    for s in current.stages:
        if s.peer_id not in live:
            able = [p for p in spares if usable(p, headroom) >= p.needs(model, s.start, s.end, ctx)]
            able.sort(key=lambda p: (p.stage_ms(model, s.start, s.end, 0), p.peer_id))
            # The fastest that holds what it needs, else the fastest: a repair is there to
            # serve again within the requests' replay deadline, and a download of a big
            # model's stage takes minutes (a slower stage can be planned away later).
            ready = [p for p in able if p.download_bytes(model, s.start, s.end) == 0]
            taker = (ready or able or [None])[0]
            if taker is None:
                return None
            spares.remove(taker)
            s = StageAssignment(taker.peer_id, s.start, s.end)
        stages.append(s)
    order = [live[s.peer_id] for s in stages]
    compute_ms = _compute_ms(model, stages, order, current.context_tokens)
    return Plan(
        model.model_id,
        current.context_tokens,
        stages=tuple(stages),
        est_token_ms=compute_ms + ring_ms(order, unknown_rtt(peers)),
    )


def _compute_ms(
    model: ModelCost,
    stages: Sequence[StageAssignment],
    order: Sequence[PeerCapacity],
    context_tokens: int,
) -> float:
    return sum(
        p.stage_ms(model, s.start, s.end, context_tokens)
        for s, p in zip(stages, order, strict=True)
    )


def estimated_token_ms(
    model: ModelCost, current: Plan, peers: Mapping[str, PeerCapacity], context_tokens: int
) -> float | None:
    """The time per token of `current` under today's capacities (of its first chain); None
    if it no longer works (a peer is gone, or its part no longer fits, in any chain)."""
    if current.chains:
        ms = [
            estimated_token_ms(model, replace(current, stages=c, chains=()), peers, context_tokens)
            for c in current.pipelines
        ]
        return None if any(m is None for m in ms) else ms[0]
    if current.replicas:
        hosts = [peers.get(p) for p in current.replicas]
        alive = [h for h in hosts if h is not None]
        n = model.n_layers
        if not alive or any(usable(h, 0.0) < h.needs(model, 0, n, context_tokens) for h in alive):
            return None
        return min(h.stage_ms(model, 0, n, context_tokens) for h in alive)
    order = [peers.get(s.peer_id) for s in current.stages]
    if any(p is None for p in order):
        return None
    live = [p for p in order if p is not None]
    for s, p in zip(current.stages, live, strict=True):
        if p.needs(model, s.start, s.end, context_tokens) > usable(p, 0.0):
            return None
    compute = _compute_ms(model, current.stages, live, context_tokens)
    return compute + ring_ms(live, unknown_rtt(peers.values()))


def should_replan(
    model: ModelCost,
    current: Plan | None,
    candidate: Plan,
    peers: Sequence[PeerCapacity],
    *,
    threshold: float = 0.25,
) -> bool:
    """Move to `candidate` if it only adds replicas to a whole model's, or drops gone ones;
    otherwise only if the current plan is broken or the gain passes `threshold`
    (0.25: at least 25% faster per token) and `MIN_GAIN_MS`, so the mesh does not flap on
    small changes: moving layers stops the split for seconds, and for a small model the
    estimate is mostly measured RTTs, which swing by milliseconds on their own (a path that
    falls back to a relay for a few seconds doubles its RTT). A candidate that moves the
    entry of a working plan must be `MOVE_ENTRY_GAIN` faster: requests in flight there are
    handed on to the new entry and prefilled there again. A working plan is never left for a
    split one of whose new stages must be downloaded first (it would stop serving for the
    download)."""
    if current is None:
        return True
    by_id = {p.peer_id: p for p in peers}
    if current.chains or candidate.chains:
        # Chains serve on their own, as replicas do: one added or dropped, or one that lost
        # a peer repaired, changes no other. Otherwise the first chains are compared.
        if estimated_token_ms(model, current, by_id, current.context_tokens) is None:
            return True
        before, after = set(current.pipelines), set(candidate.pipelines)
        if before <= after or after <= before:
            return True
        current, candidate = current.chain_of(""), candidate.chain_of("")
    now = estimated_token_ms(model, current, by_id, current.context_tokens)
    if now is None:
        return True
    if not current.split and not candidate.split:
        # Replicas serve on their own: one more (or one gone) changes no other replica's
        # part, so the mesh follows the replicas there are without a gain threshold.
        if any(r not in by_id for r in current.replicas):
            return True
        if set(candidate.replicas) > set(current.replicas):
            return True
    if candidate.split and _downloads(model, current, candidate, by_id):
        # A working split stops while the new one's parts load: one that must download a
        # stage first would stop it for minutes (a 70B stage at 100 MB/s), longer than
        # requests wait to replay (the scale simulation's replans after a cut healed).
        return False
    gain = now - candidate.est_token_ms
    if _entries(candidate).isdisjoint(_entries(current)):
        threshold = max(threshold, MOVE_ENTRY_GAIN)
    return candidate.est_token_ms * (1.0 + threshold) < now and gain >= MIN_GAIN_MS


def _downloads(
    model: ModelCost, current: Plan, candidate: Plan, peers: Mapping[str, PeerCapacity]
) -> bool:
    """Some stage of `candidate` that `current` does not have on that peer must be
    downloaded before it loads."""
    kept = {(s.peer_id, s.start, s.end) for s in current.stages}
    return any(
        (s.peer_id, s.start, s.end) not in kept
        and s.peer_id in peers
        and peers[s.peer_id].download_bytes(model, s.start, s.end) > 0
        for s in candidate.stages
    )


def _entries(p: Plan) -> set[str]:
    """The peers where requests for `p` start: a split's first stage, or its replicas."""
    return {c[0].peer_id for c in p.pipelines} if p.split else set(p.replicas)
