"""The assigner's ledger (`assignment._Assigner`): what each model costs on each peer (its
speeds in the model's layers per second, its share of a peer's memory, what a replica serves
there), what each model placed asks of its peers' compute, and the free memory each peer has
left as models take and give back their shares. Mixed into the assigner, whose snapshot
(models, peers, demand, the placing so far) it reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from meshagent.placement.planner import PeerCapacity
from meshagent.placement.shares import Free, Placing, Share, stage_share
from meshagent.placement.thresholds import FAIR_SHARE


class Ledger:
    """The ledger of `assignment._Assigner`."""

    # What each model costs where.

    def _peers_for(self, m: str) -> list[PeerCapacity]:
        """The peers that may take part in `m`, by id."""
        if self.eligible is None:
            return self.peers
        allowed = self.eligible.get(m, frozenset())
        return [p for p in self.peers if p.peer_id in allowed]

    def _scale(self, m: str, pid: str) -> PeerCapacity:
        """Peer `pid` as model `m` sees it: speeds in its layers per second, holding its
        file or not."""
        key = (m, pid)
        if key not in self._scaled:
            model, peer = self.models[m], self.by_id[pid]
            per_layer = 1e9 / model.flops_per_layer if model.flops_per_layer > 0 else 1.0
            held = self.holders is None or pid in self.holders.get(m, frozenset())
            self._scaled[key] = replace(
                peer,
                speed=peer.speed * per_layer,
                vram_speed=peer.vram_speed * per_layer,
                whole_file=held,
            )
        return self._scaled[key]

    def _cut(self, m: str, pid: str, share: Share | Free) -> PeerCapacity:
        """Peer `pid` as `m` sees it, with `share` of its memory (or what it has free)."""
        return replace(
            self._scale(m, pid),
            memory_bytes=share.memory,
            vram_bytes=share.vram,
            spare_bytes=share.spare,
        )

    def _usable(self, f: Free) -> int:
        return int((f.memory + f.vram) * (1.0 - self.headroom))

    def _whole_share(self, m: str, free: Free) -> Share | None:
        key = (m, free.memory, free.vram, free.spare)
        if key not in self._shares:
            model = self.models[m]
            self._shares[key] = stage_share(model, 0, model.n_layers, self.ctx, free, self.headroom)
        return self._shares[key]

    def _replica_rate(self, m: str, pid: str, share: Share) -> float:
        """Tokens per second one replica of `m` on this share serves, alone on the peer."""
        key = (m, pid, share)
        if key not in self._ms:
            model = self.models[m]
            ms = self._cut(m, pid, share).stage_ms(model, 0, model.n_layers, self.ctx)
            self._ms[key] = self._per_s(ms)
        return self._ms[key]

    def _fits_one_peer(self, m: str) -> bool:
        """Some peer could hold the model whole with all it offers."""
        if m not in self._whole:
            self._whole[m] = any(
                self._whole_share(m, Free(p.memory_bytes, p.vram_bytes, p.spare_bytes)) is not None
                for p in self._peers_for(m)
            )
        return self._whole[m]

    # What each model asks of the peers' compute.

    def _use(self, m: str) -> dict[str, float]:
        """The share of each of its peers' compute `m` is expected to take: its recent
        demand over what its placement serves, at most all of it."""
        known = self._uses.get(m)
        if known is not None and known[0] == self._changes:
            return known[1]
        placing = self.placing[m]
        demand = self.rates[m].recent
        if placing.split:
            serves = placing.split_rate
        else:
            serves = 0.0
            for pid in sorted(placing.shares):
                serves += self._replica_rate(m, pid, placing.shares[pid])
        busy = min(1.0, demand / max(serves, 1e-9))
        use = {pid: busy for pid in sorted(placing.shares)}
        self._uses[m] = (self._changes, use)
        return use

    def _room(self, pid: str, m: str, without: set[str] | None = None) -> float:
        """The share of `pid`'s compute the models placed there, other than `m` (and those
        `without`), leave."""
        used = 0.0
        for x in sorted(self.placing):
            if x != m and pid in self.placing[x].shares and not (without and x in without):
                used += self._use(x)[pid]
        return max(0.0, 1.0 - used)

    def _serves_on(self, m: str, pid: str, share: Share) -> float:
        """Tokens per second a replica of `m` on `pid` serves, its speed counted for the
        share of the peer's compute the other models leave (`FAIR_SHARE` at least)."""
        return self._replica_rate(m, pid, share) * max(FAIR_SHARE, self._room(pid, m))

    def _serves(self, m: str, shares: Mapping[str, Share]) -> float:
        """Tokens per second `m`'s replicas on `shares` serve (`_serves_on` each)."""
        total = 0.0
        for pid in sorted(shares):
            total += self._serves_on(m, pid, shares[pid])
        return total

    # The ledger of free memory.

    def _take(self, pid: str, share: Share) -> None:
        self._changes += 1
        f = self.free[pid]
        f.memory -= share.memory
        f.vram -= share.vram
        f.spare -= share.spare

    def _give(self, pid: str, share: Share) -> None:
        self._changes += 1
        f = self.free[pid]
        f.memory += share.memory
        f.vram += share.vram
        f.spare += share.spare

    def _hold(self, m: str, placing: Placing) -> None:
        for pid in sorted(placing.shares):
            self._take(pid, placing.shares[pid])
        self.placing[m] = placing
        self.reasons.pop(m, None)

    def _drop(self, m: str) -> Placing:
        placing = self.placing.pop(m)
        for pid in sorted(placing.shares):
            self._give(pid, placing.shares[pid])
        return placing

    def _fits_shares(self, shares: Mapping[str, Share]) -> bool:
        for pid in sorted(shares):
            s, f = shares[pid], self.free[pid]
            if s.memory > f.memory or s.vram > f.vram or s.spare > f.spare:
                return False
        return True

    def _per_s(self, ms: float) -> float:
        """Tokens per second a replica or chain at `ms` milliseconds a token serves, with
        the streams it decodes together."""
        return 1000.0 * self.gain / max(ms, 1e-9)
