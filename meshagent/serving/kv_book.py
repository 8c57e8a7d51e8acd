"""The book of one engine's slots and kept prefixes: what each slot's KV holds, and the ended
sequences' KV kept for later prompts that share their prefix.

Three places run a model's slots and keep prefixes, and each keeps this one book: the whole
model's executor (`executor.LocalExecutor`), a split's entry (`pipeline.PipelineExecutor`,
for its first stage) and every later stage (`stage_server.StageServer`, told what to keep by
the entry). The scheduler decides what is kept and freed (`serving/prefix_cache.py`); the book
carries it out on the engine, counts the bytes and, where the decisions come from a peer,
holds them to a budget.

A slot's end is the position after the last token it took: a forward that starts before it
follows a draft whose tail was rejected, and the slot's KV is cut back first (`take`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from meshagent.serving.steps import Step


class SequenceKv(Protocol):
    """The KV cache of an engine's sequences (one per slot)."""

    def clear_sequence(self, seq_id: int) -> None: ...

    def trim_sequence(self, seq_id: int, keep: int) -> None: ...

    def export_sequence(self, seq_id: int, keep: int) -> bytes: ...

    def import_sequence(self, seq_id: int, state: bytes) -> None: ...


class KeptPrefixError(ValueError):
    """A kept prefix asked for is not held, or would pass the book's limits."""


class KvBook:
    """Slots' ends and kept prefixes of `kv`. `budget` bytes and `max_kept` entries bound
    what `keep` holds (None: the caller's own decisions, bounded where they are made)."""

    def __init__(
        self,
        kv: SequenceKv,
        *,
        budget: int | None = None,
        max_kept: int | None = None,
        holder: str = "this engine",
    ) -> None:
        self.kv = kv
        self.holder = holder  # who holds them, as errors say
        self.budget = budget
        self.max_kept = max_kept
        self._kept: dict[int, bytes] = {}  # prefix-cache entry -> its KV
        self._ends: dict[int, int] = {}  # slot -> the position after its last token

    # ----- kept prefixes -----

    def keep(self, entry: int, slot: int, length: int) -> None:
        """Keep the KV of `slot`'s first `length` positions as `entry`, within the limits."""
        state = self.kv.export_sequence(slot, length)
        full = self.max_kept is not None and len(self._kept) >= self.max_kept
        if full and entry not in self._kept:
            raise KeptPrefixError(
                f"kept prefix {entry} would be more than the {self.max_kept} {self.holder} holds"
            )
        if self.budget is not None:
            total = self.kept_bytes() - len(self._kept.get(entry, b"")) + len(state)
            if total > self.budget:
                raise KeptPrefixError(
                    f"kept prefix {entry} would bring {self.holder}'s kept prefixes to {total} "
                    f"bytes, over its budget of {self.budget}"
                )
        self._kept[entry] = state

    def drop(self, entries: Iterable[int]) -> None:
        for entry in entries:
            self._kept.pop(entry, None)

    def restore(self, slot: int, entry: int, length: int) -> None:
        """Start `slot` from kept prefix `entry`'s first `length` positions."""
        state = self._kept.get(entry)
        if state is None:
            raise KeptPrefixError(f"kept prefix {entry} is not held by {self.holder}")
        self.kv.import_sequence(slot, state)
        self.kv.trim_sequence(slot, length)
        self._ends[slot] = length

    def kept_bytes(self) -> int:
        """Bytes of KV kept now (read from any thread: list() of a dict's values is one step
        under the GIL, while the worker may be adding one)."""
        return sum(len(b) for b in list(self._kept.values()))

    @property
    def kept(self) -> int:
        return len(self._kept)

    # ----- slots -----

    def release(self, slot: int) -> None:
        """`slot`'s sequence ended: its KV is cleared."""
        self.kv.clear_sequence(slot)
        self._ends.pop(slot, None)

    def take(self, slot: int, pos: int, n: int) -> None:
        """`n` tokens of `slot` run at `pos` next: a rejected draft's tail past `pos` goes."""
        if self._ends.get(slot, pos) > pos:
            self.kv.trim_sequence(slot, pos)
        self._ends[slot] = pos + n

    def reset(self, n_slots: int) -> None:
        """Start afresh: every slot cleared, nothing kept."""
        for slot in range(n_slots):
            self.kv.clear_sequence(slot)
        self._ends.clear()
        self._kept.clear()

    def apply(self, step: Step) -> None:
        """What `step` does to slots and kept prefixes, in its order (`Step`): the entries no
        restore or save of it names are freed first, then saves kept, released slots
        cleared and opened ones restored, then the rest freed, so the kept bytes never pass
        the scheduler's budget."""
        early, late = step.drops()
        self.drop(early)
        for save in step.saves:
            self.keep(save.entry, save.slot, save.tokens)
        for slot in step.released:
            self.release(slot)
        for op in step.opened:
            if op.restore is not None:
                self.restore(op.slot, *op.restore)
        self.drop(late)


def measure_kept_size(
    kv: SequenceKv,
    prefill: Callable[[int, list[int]], object],
    tokens: list[int],
    *,
    scale: float = 1.0,
    slot: int = 0,
) -> Callable[[int], int]:
    """What a kept prefix of n tokens costs in bytes: `kv`'s export of two lengths of
    `tokens` (prefilled into `slot` by `prefill`), a fixed part and a part per token (the
    format is linear in its cells), times `scale` (a split's entry counts for its biggest
    stage). Clears `slot`."""
    kv.clear_sequence(slot)
    try:
        prefill(slot, tokens)
        sizes = [len(kv.export_sequence(slot, n)) for n in (len(tokens), 1)]
    finally:
        kv.clear_sequence(slot)
    per_token = (sizes[0] - sizes[1]) / (len(tokens) - 1) * scale
    fixed = sizes[1] * scale - per_token
    return lambda n: int(fixed + per_token * n + 0.5)
