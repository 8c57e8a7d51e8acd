"""Which token prefixes have their KV cache kept, and which to reuse: a sans-IO index.

A sequence that ends leaves its tokens' KV behind as an *entry* (the executor keeps the bytes;
this index keeps the token ids, their size and when each was last used). A new sequence looks
up the entry that shares the longest prefix with its prompt, and prefills only the rest.

The lookup is linear in the prompt, not in the number of entries: the tokens are cut into
blocks of `BLOCK`, each block keyed by a hash of every token up to its end (a hash chain, so
equal keys mean equal prefixes, barring collisions), and each key maps to the entries that
hold that prefix. The longest run of keys found names candidate entries; the exact shared
length is then measured on the tokens themselves, so a collision costs a shorter match,
never a wrong one.

Entries are evicted least recently used first, so that their bytes stay within `budget`. An
entry whose tokens are a prefix of a newer one is dropped (the newer one serves every lookup
it would), and a sequence whose tokens an entry already holds adds nothing.

With `whole` set (a model with a recurrent state, kept as it was at each entry's end), an
entry serves only a prompt that holds all of it: a lookup returns the longest such entry, and
an entry's tokens found inside a longer one are still stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BLOCK = 16  # tokens per key: a match is found in whole blocks, then measured exactly
MIN_REUSE = 16  # a shorter shared prefix is not worth restoring a cache for


@dataclass(frozen=True)
class Entry:
    id: int
    tokens: tuple[int, ...]
    size: int  # bytes, as `size_of` gave them


@dataclass(frozen=True)
class Stored:
    """What `insert` did: the new entry's id (None: nothing new was stored) and the entries
    evicted or replaced, whose bytes the executor frees."""

    entry: int | None
    dropped: tuple[int, ...] = ()


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    a, b = tuple(a), tuple(b)  # (a list never equals a tuple)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # slices compare in C: a binary search beats a loop over tokens
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _keys(tokens: Sequence[int]) -> list[int]:
    """One key per whole block: a hash of the tokens up to that block's end."""
    keys, key = [], 0
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hash((key, tuple(tokens[end - BLOCK : end])))
        keys.append(key)
    return keys


class PrefixIndex:
    """Entries of kept KV by their token ids, within `budget` bytes; `size_of(n)` is what an
    entry of n tokens costs."""

    def __init__(self, budget: int, size_of: Callable[[int], int], *, whole: bool = False) -> None:
        self.budget = budget
        self.size_of = size_of
        self.whole = whole
        self.used = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._by_key: dict[int, set[int]] = {}
        self._next = 0
        self.hits = 0
        self.misses = 0

    @property
    def next_id(self) -> int:
        """The id the next entry gets: ids only grow, also past `clear`."""
        return self._next

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The entry sharing the longest prefix with `tokens` and that length, if it is at
        least MIN_REUSE; the entry counts as used now. Counts a hit or a miss."""
        found = self._longest(tokens)
        if found is None or found[1] < MIN_REUSE:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(found[0])
        return found

    def _longest(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        candidates: set[int] = set()
        for key in _keys(tokens):
            held = self._by_key.get(key)
            if not held:
                break
            # Whole entries only: any entry along the way may be one the prompt holds.
            candidates = candidates | held if self.whole else held
        best: tuple[int, int] | None = None
        for entry_id in candidates:
            held_tokens = self._entries[entry_id].tokens
            n = shared_length(tokens, held_tokens)
            if self.whole and n < len(held_tokens):
                continue
            if best is None or n > best[1]:
                best = (entry_id, n)
        return best

    def insert(self, tokens: Sequence[int]) -> Stored:
        """Keep the KV of `tokens` (a sequence that ended): a new entry, unless one holds
        them already or they are too short or too big; evicts what the budget needs."""
        tokens = tuple(tokens)
        size = self.size_of(len(tokens))
        if len(tokens) < MIN_REUSE or size > self.budget:
            return Stored(None)
        found = self._longest(tokens)
        if found is not None and found[1] == len(tokens):
            # An entry holds them all (or more; `whole`: exactly them, as `_longest` finds
            # only entries the tokens hold whole).
            self._entries.move_to_end(found[0])
            return Stored(None)
        keys = _keys(tokens)
        # Entries that are a prefix of the new one: it serves every lookup they would.
        covered = {e for key in keys for e in self._by_key.get(key, ())}
        dropped = [
            e
            for e in covered
            if len(self._entries[e].tokens) <= len(tokens)
            and tokens[: len(self._entries[e].tokens)] == self._entries[e].tokens
        ]
        for e in dropped:
            self._remove(e)
        while self.used + size > self.budget:
            dropped.append(self._remove(next(iter(self._entries))))
        entry = Entry(self._next, tokens, size)
        self._next += 1
        self._entries[entry.id] = entry
        self.used += size
        for key in keys:
            self._by_key.setdefault(key, set()).add(entry.id)
        return Stored(entry.id, tuple(dropped))

    def _remove(self, entry_id: int) -> int:
        entry = self._entries.pop(entry_id)
        self.used -= entry.size
        for key in _keys(entry.tokens):
            held = self._by_key[key]
            held.discard(entry_id)
            if not held:
                del self._by_key[key]
        return entry_id

    def clear(self) -> tuple[int, ...]:
        """Forget every entry (the cache behind them is gone); returns their ids."""
        dropped = tuple(self._entries)
        self._entries.clear()
        self._by_key.clear()
        self.used = 0
        return dropped
