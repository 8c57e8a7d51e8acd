"""The catalogue as one agent knows it: the winning operation on each name (no I/O, no trio).

Operations on a name are ordered by `SignedEntry.rank` (Lamport version, then author): the
highest wins wherever it is heard, whatever the order, so every agent that has heard the same
entries holds the same book. The live catalogue is the names whose winner is an add. A
removal is kept as a tombstone, so that an older add heard later (from an agent that was away)
does not bring the model back; a tombstone older than `TOMBSTONE_TTL` is dropped, and past
that an add older than it may come back.

The book is bounded: at most `MAX_KEPT` names, and `MAX_GOSSIPED` entries in what an agent
gossips, live adds first (newest first), then the newest tombstones.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshagent.catalog.entry import VERSIONS, CatalogEntry, SignedEntry
from meshagent.errors import CatalogError
from meshagent.gossip.peer_record import MAX_CATALOG

TOMBSTONE_TTL = 7 * 24 * 3600.0  # seconds
MAX_GOSSIPED = MAX_CATALOG  # entries in one agent's gossip record (`PeerRecord.catalog`)
# Models an agent lets its user add: fewer than are gossiped, so that the newest removals
# travel with them.
MAX_LIVE = MAX_GOSSIPED - 8
MAX_KEPT = 4 * MAX_GOSSIPED  # names remembered, tombstones beyond those gossiped included


def _kept_first(signed: SignedEntry) -> tuple[bool, int, tuple[int, str, bytes]]:
    """The order in which entries are kept and gossiped (highest first)."""
    return (signed.entry.is_add, signed.entry.time, signed.rank)


def key_of(name: str) -> str:
    """Names are compared as the API compares them: without case."""
    return name.casefold()


class CatalogBook:
    def __init__(self, entries: Iterable[SignedEntry] = (), *, now: float) -> None:
        self._winners: dict[str, SignedEntry] = {}
        self.merge(entries, now=now)

    def merge(self, entries: Iterable[SignedEntry], *, now: float) -> bool:
        """Take what wins of `entries`; says whether the book changed. Expired tombstones
        are dropped, those here and those heard alike."""
        changed = self.expire(now=now)
        for signed in entries:
            if _expired(signed, now):
                continue
            key = key_of(signed.entry.name)
            held = self._winners.get(key)
            if held is None or signed.rank > held.rank:
                self._winners[key] = signed
                changed = True
        if len(self._winners) > MAX_KEPT:
            kept = sorted(self._winners.values(), key=_kept_first, reverse=True)[:MAX_KEPT]
            self._winners = {key_of(s.entry.name): s for s in kept}
        return changed

    def expire(self, *, now: float) -> bool:
        """Drop tombstones older than `TOMBSTONE_TTL`; says whether any was dropped."""
        gone = [k for k, s in self._winners.items() if _expired(s, now)]
        for k in gone:
            del self._winners[k]
        return bool(gone)

    def winner(self, name: str) -> SignedEntry | None:
        """The operation that stands on `name` (an add or a tombstone), if any."""
        return self._winners.get(key_of(name))

    def live(self) -> dict[str, SignedEntry]:
        """The catalogue: each name whose winner is an add, by the name its entry gives,
        in order of name."""
        adds = sorted(
            (s for s in self._winners.values() if s.entry.is_add),
            key=lambda s: key_of(s.entry.name),
        )
        return {s.entry.name: s for s in adds}

    def next_version(self, name: str) -> int:
        """The version a new operation on `name` takes: one past the highest known."""
        held = self.winner(name)
        version = 1 if held is None else held.entry.version + 1
        if version not in VERSIONS:
            assert held is not None
            raise CatalogError(
                f"{name} is at the last version a catalogue entry may have, set by "
                f"{held.author}: that member's entries on it can no longer be overruled"
            )
        return version

    def entries(self) -> tuple[SignedEntry, ...]:
        """Every entry kept, in the order they are kept (what is saved to disk)."""
        return tuple(sorted(self._winners.values(), key=_kept_first, reverse=True))

    def gossiped(self) -> tuple[SignedEntry, ...]:
        """What an agent gossips: at most `MAX_GOSSIPED` entries, live adds first."""
        return self.entries()[:MAX_GOSSIPED]

    def __len__(self) -> int:
        return len(self._winners)


def _expired(signed: SignedEntry, now: float) -> bool:
    entry: CatalogEntry = signed.entry
    return not entry.is_add and entry.time + TOMBSTONE_TTL < now
