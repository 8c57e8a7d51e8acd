"""The rules for a split's chains (docs/placement.md, "Several chains"): a chain kept as it
stands or repaired in its place, chains grown by demand up to `MAX_CHAINS` and shrunk once
demand settles low, a pinned split's standby, and the plan of a split of several chains.
Mixed into the assigner (`assignment._Assigner`), whose ledger of free memory, shares and
rates (`ledger.py`) they use."""

from __future__ import annotations

from meshagent.placement.costs import MAX_CHAINS
from meshagent.placement.planner import (
    Plan,
    StageAssignment,
    estimated_token_ms,
    repair,
)
from meshagent.placement.shares import Placing, Share, stage_share
from meshagent.placement.thresholds import GROW_AT, GROW_TO, MIN_REPLICA, SHRINK_AT, STANDBY


class SplitChains:
    """The chain rules of `assignment._Assigner`."""

    def _intact_chain(
        self, m: str, chain: tuple[StageAssignment, ...], allowed: set[str]
    ) -> tuple[dict[str, Share], float, tuple[StageAssignment, ...]] | None:
        """`chain` of `m`'s plan in force as it stands, where every stage's peer still takes
        part and holds its room: the shares and what it serves; else None."""
        model = self.models[m]
        shares = {}
        for s in chain:
            f = self.free.get(s.peer_id) if s.peer_id in allowed else None
            share = None
            if f is not None:
                share = stage_share(model, s.start, s.end, self.ctx, f, self.headroom)
            if share is None:
                return None
            shares[s.peer_id] = share
        one = Plan(m, self.ctx, stages=chain)
        caps = {pid: self._cut(m, pid, shares[pid]) for pid in sorted(shares)}
        ms = estimated_token_ms(model, one, caps, self.ctx)
        est = self.current[m].est_token_ms if ms is None else ms
        return shares, self._per_s(est), chain

    def _repair_chain(
        self, m: str, chain: tuple[StageAssignment, ...], taken: frozenset[str]
    ) -> tuple[dict[str, Share], float, tuple[StageAssignment, ...]] | None:
        """`chain` of `m` with its lost stages given to spares (`planner.repair`) over free
        memory: its peers that are left and peers not in `taken`; the shares, what it serves
        and its stages, or None."""
        model = self.models[m]
        mine = {s.peer_id for s in chain}
        caps = []
        for p in self._peers_for(m):
            pid = p.peer_id
            if (pid in mine or pid not in taken) and self._usable(self.free[pid]) > 0:
                caps.append(self._cut(m, pid, self.free[pid]))
        fixed = repair(model, Plan(m, self.ctx, stages=chain), caps, headroom=self.headroom)
        if fixed is None:
            return None
        shares = {}
        for s in fixed.stages:
            share = stage_share(
                model, s.start, s.end, self.ctx, self.free[s.peer_id], self.headroom
            )
            if share is None:
                return None
            shares[s.peer_id] = share
        return shares, self._per_s(fixed.est_token_ms), fixed.stages

    def _grow_chains(self, m: str) -> None:
        """More chains of a split when recent demand passes `GROW_AT` of what its chains
        serve (`_chains_serve`): as many as it takes, in one go, each on free memory over
        peers of its own and serving at least `MIN_REPLICA` of what the first ones do,
        `MAX_CHAINS` in all. Never by eviction."""
        r = self.rates[m]
        placing = self.placing[m]
        least = self._least_chains(m)
        if r.recent <= GROW_AT * self._chains_serve(m, placing) and len(placing.chains) >= least:
            return
        target = max(r.recent, r.latest, r.peak)
        alone = placing.split_rate
        while len(placing.chains) < MAX_CHAINS and (
            len(placing.chains) < least or target > GROW_TO * self._chains_serve(m, placing)
        ):
            more, _ = self._split(m, besides=frozenset(placing.shares))
            if more is None or more.split_rate < MIN_REPLICA * alone:
                return
            for pid in sorted(more.shares):
                self._take(pid, more.shares[pid])
            placing.add_chain(more.shares, more.split_rate, more.chains[0].stages)

    def _shrink_chains(self, m: str) -> None:
        """Fewer chains once demand has settled well below what they serve: the last ones
        first, all that can go in one go (the first chain stays, and a pinned split's
        standby)."""
        busiest = self._settled(m)
        if busiest is None:
            return
        placing = self.placing[m]
        limit = SHRINK_AT
        while len(placing.chains) > self._least_chains(m):
            rest = placing.split_rate - placing.chains[-1].rate
            if self._standby(m, len(placing.chains) - 1):
                rest -= placing.chains[-2].rate
            if busiest > limit * rest:
                return
            self._drop_chain(m)
            limit = GROW_TO

    def _least_chains(self, m: str) -> int:
        """The chains `m`'s split keeps at least, where free memory holds them: what its
        pinning agents ask for (`--chains`), and a pinned split's standby."""
        return max(self.least_chains.get(m, 1), 1 + STANDBY if m in self.pins else 1)

    def _standby(self, m: str, chains: int) -> bool:
        """Whether the last of `chains` chains of `m` is a standby: a pinned split's spare
        chain, which a chain that loses a stage hands its requests to at once (and which
        serves meanwhile); demand grows the chains besides it."""
        return m in self.pins and chains > STANDBY

    def _chains_serve(self, m: str, placing: Placing) -> float:
        """Tokens per second `m`'s chains serve, a standby's left out."""
        if self._standby(m, len(placing.chains)):
            return placing.split_rate - placing.chains[-1].rate
        return placing.split_rate

    def _drop_chain(self, m: str) -> Placing:
        """Take the last chain off `m`'s split; what it held, as a placing of its own."""
        placing = self.placing[m]
        chain = placing.chains.pop()
        gone = {pid: placing.shares.pop(pid) for pid in sorted(chain.peers)}
        for pid in sorted(gone):
            self._give(pid, gone[pid])
        placing.split_rate -= chain.rate
        dropped = Placing(True, {})
        dropped.add_chain(gone, chain.rate, chain.stages)
        return dropped

    def _chains_plan(self, m: str, placing: Placing) -> Plan:
        """The plan of a split of several chains: each chain as it was kept, repaired or
        planned, in that order (a chain's memory was cut to its stages, so they stand)."""
        first, *more = placing.chains
        return Plan(
            m,
            self.ctx,
            stages=first.stages,
            est_token_ms=1000.0 * self.gain / max(first.rate, 1e-9),
            chains=tuple(c.stages for c in more),
        )
