"""Finding room for a model on the mesh's free memory, for the assigner
(`assignment._Assigner`): the peer where a replica would serve most (taking other models'
spare replicas where that is much better), a split over free memory (the planner's), and the
words for why there is none. Mixed into the assigner, whose ledger (`ledger.py`) it reads and
changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshagent.placement.planner import PlanError, plan
from meshagent.placement.shares import Free, Placing, Share, stage_share
from meshagent.placement.thresholds import CLOSE, FAIR_SHARE, GROW_TO, RECLAIM
from meshagent.wording import size


class Room:
    """Finding room, for `assignment._Assigner`."""

    def _prefer(self, m: str) -> frozenset[str]:
        return frozenset(self.current[m].peers) if m in self.current else frozenset()

    def _best_peer(self, m: str, least: float = 0.0) -> tuple[str, Share, float] | None:
        """Where to add a replica of `m`, with its share and what it would serve there
        (`_serves_on`), if that is at least `least`: where it would serve most (its speed
        times the compute the others leave); among peers within `CLOSE` of that, one that
        served it, then one that holds its file. A peer whose memory other models' spare
        replicas hold (`_spare_on`) counts when it would serve `RECLAIM` times what the best
        free one does; those replicas are then dropped."""
        taken = self.placing[m].shares if m in self.placing else {}
        free_options, reclaim_options = [], []
        for p in self._peers_for(m):
            pid = p.peer_id
            if pid in taken:
                continue
            share = self._whole_share(m, self.free[pid])
            if share is not None:
                rate = self._replica_rate(m, pid, share) * self._room(pid, m)
                free_options.append((rate, pid, share, ()))
                continue
            room = Free(self.free[pid].memory, self.free[pid].vram, self.free[pid].spare)
            spare: list[str] = []
            for x in self._spare_on(pid, m):
                s = self.placing[x].shares[pid]
                room = Free(room.memory + s.memory, room.vram + s.vram, room.spare + s.spare)
                spare.append(x)
                share = self._whole_share(m, room)
                if share is not None:
                    rate = self._replica_rate(m, pid, share) * self._room(pid, m, set(spare))
                    reclaim_options.append((rate, pid, share, tuple(spare)))
                    break
        best = _pick(free_options, self._prefer(m), lambda pid: self._scale(m, pid).whole_file)
        if reclaim_options:
            top = max(reclaim_options, key=lambda o: (o[0], o[1]))
            if best is None or top[0] >= RECLAIM * best[0]:
                best = top
        if best is None:
            return None
        _, pid, share, spare_models = best
        rate = self._replica_rate(m, pid, share) * max(
            FAIR_SHARE, self._room(pid, m, set(spare_models))
        )
        if rate < least:
            return None
        for x in spare_models:
            self._give(pid, self.placing[x].shares.pop(pid))
        return pid, share, rate

    def _spare_on(self, pid: str, m: str) -> list[str]:
        """The models other than `m` with a replica on `pid` they can spare: one of several,
        without which the rest would still serve their demand under `GROW_TO` of what they
        can. Lowest priority first."""
        out = []
        for x in sorted(self.placing, key=self._priority, reverse=True):
            placing = self.placing[x]
            if x == m or placing.split or pid not in placing.shares or len(placing.shares) < 2:
                continue
            r = self.rates[x]
            rest = {p: s for p, s in placing.shares.items() if p != pid}
            if max(r.recent, r.window) <= GROW_TO * self._serves(x, rest):
                out.append(x)
        return out

    def _split(
        self, m: str, *, besides: frozenset[str] = frozenset()
    ) -> tuple[Placing | None, str | None]:
        """A split of `m` over free memory (the planner's), or None and why not. `besides`:
        the peers of its chains placed already, which a further chain leaves out (and it
        is planned afresh, not from the plan in force)."""
        model = self.models[m]
        free_caps = []
        for p in self._peers_for(m):
            f = self.free[p.peer_id]
            if self._usable(f) > 0 and p.peer_id not in besides:
                free_caps.append(self._cut(m, p.peer_id, f))
        cur = None if besides else self.current.get(m)
        try:
            found = plan(
                model, free_caps, context_tokens=self.ctx, headroom=self.headroom, current=cur
            )
        except PlanError as e:
            return None, str(e)
        if not found.split:
            return None, f"{m}: a peer holds it whole"
        shares: dict[str, Share] = {}
        for s in found.stages:
            f = self.free[s.peer_id]
            share = stage_share(model, s.start, s.end, self.ctx, f, self.headroom)
            if share is None:  # cannot be: the planner found it fits
                return None, f"{m}: the split found does not fit its peers' free memory"
            shares[s.peer_id] = share
        cut = [self._cut(m, pid, shares[pid]) for pid in sorted(shares)]
        try:
            plan(model, cut, context_tokens=self.ctx, headroom=self.headroom, current=cur)
        except PlanError:
            # The planner cuts its layers otherwise on exactly the stages' bytes: give the
            # split all that its peers have free.
            shares = {
                pid: Share(self.free[pid].memory, self.free[pid].vram, self.free[pid].spare)
                for pid in shares
            }
        placing = Placing(True, {})
        placing.add_chain(shares, self._per_s(found.est_token_ms), found.stages)
        return placing, None

    def _fit(self, m: str) -> tuple[Placing | None, str | None]:
        """Room for `m` on free memory, or None and why not."""
        if self._fits_one_peer(m):
            best = self._best_peer(m)
            if best is None:
                return None, self._no_room(m)
            return Placing(False, {best[0]: best[1]}), None
        if self.models[m].split_refusal is not None:
            return None, self._planner_says(m)
        return self._split(m)

    def _planner_says(self, m: str) -> str | None:
        """The planner's words for why `m` fits nowhere with every peer's whole offer, or
        None when it would fit an empty mesh."""
        caps = [self._scale(m, p.peer_id) for p in self._peers_for(m)]
        if not caps:
            return f"no peer takes part in {m} (none has its file or can fetch it)"
        try:
            plan(self.models[m], caps, context_tokens=self.ctx, headroom=self.headroom)
        except PlanError as e:
            return str(e)
        return None

    def _no_room(self, m: str) -> str:
        model = self.models[m]
        need = model.stage_bytes(0, model.n_layers, self.ctx)
        largest = max((self._usable(self.free[p.peer_id]) for p in self._peers_for(m)), default=0)
        return (
            f"no memory anywhere: needs {size(need)} on one peer, the largest free "
            f"offer is {size(largest)}"
        )


def _pick(
    options: Sequence[tuple[float, str, Share, tuple[str, ...]]],
    prefer: frozenset[str],
    holds: Any,
) -> tuple[float, str, Share, tuple[str, ...]] | None:
    """The option serving most, unless one within `CLOSE` of it is on a peer in `prefer`,
    then one on a peer that `holds` the file; then by rate and peer id."""
    if not options:
        return None
    top = max(o[0] for o in options)
    return min(
        (o for o in options if o[0] >= top * (1.0 - CLOSE)),
        key=lambda o: (o[1] not in prefer, not holds(o[1]), -o[0], o[1]),
    )
