"""The `Engine` interface: what serving needs from anything that runs a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from meshagent.errors import OutOfRange


def check_tokens(tokens: Sequence[int], n_vocab: int) -> None:
    """Raise OutOfRange unless every token id is of a vocabulary of `n_vocab` (llama.cpp
    aborts the process on one that is not)."""
    if len(tokens) and (min(tokens) < 0 or max(tokens) >= n_vocab):
        bad = next(t for t in tokens if not 0 <= t < n_vocab)
        raise OutOfRange(f"token id {bad} is outside the vocabulary (0-{n_vocab - 1})")


@dataclass(frozen=True)
class ModelInfo:
    id: str  # the name clients use in requests
    path: str
    architecture: str
    n_layers: int
    n_vocab: int
    n_ctx_train: int
    size_bytes: int
    chat_template: str | None
    bos_token: str
    eos_token: str
    fim: tuple[int, int, int] | None = None  # fill-in-the-middle: prefix, suffix, middle


class Constraint(Protocol):
    """Which tokens may come next (a grammar, `engine/grammar.py`), advanced by each token
    sampled (`serving/sampling.py`)."""

    def allows(self, token: int) -> bool: ...

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token it does not allow now set to -inf."""
        ...

    def accept(self, token: int) -> None:
        """Advance past `token`; raises EngineError if it is not allowed."""
        ...


@dataclass(frozen=True)
class ForwardItem:
    """Tokens of one sequence to run, starting at position `pos`."""

    seq_id: int
    pos: int
    tokens: Sequence[int]
    want_logits: bool  # logits for the last token of `tokens`
    rows: int = 1  # with want_logits: logits for this many last tokens (a draft's window)


class TokenModel(Protocol):
    """What serving needs to turn text into tokens and back: a whole engine, or the entry of
    a split (whose layers run elsewhere). `n_slots` sequences of up to `slot_ctx` tokens."""

    info: ModelInfo
    n_slots: int
    slot_ctx: int

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...

    def check_grammar(self, text: str, trigger: str | None = None) -> None:
        """Raise EngineError if `text` is not a grammar `constraint` accepts."""
        ...


class Engine(TokenModel, Protocol):
    """A loaded model that computes logits for its slots' sequences.

    `forward` blocks (run it off the event loop); everything else is cheap.
    """

    # Whether `trim_sequence` can cut a sequence back (not for a recurrent state, which only
    # summarises the whole sequence): what speculative decoding needs to drop a draft.
    rewindable: bool

    def forward(self, items: Sequence[ForwardItem]) -> list[np.ndarray | None]:
        """Run every item in one batch; returns, per item, its last token's logits or None
        (an item with `rows` > 1: an array of that many rows, one per last token)."""
        ...

    def clear_sequence(self, seq_id: int) -> None:
        """Forget a sequence's KV cache so its slot can be reused."""
        ...

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        """Forget positions `keep` and later of a sequence."""
        ...

    def reset(self) -> None:
        """Forget every sequence."""
        ...

    def export_sequence(self, seq_id: int, keep: int) -> bytes:
        """The KV of a sequence's first `keep` positions (later ones are cut first), as
        bytes that `import_sequence` loads into a slot of the same engine: a kept prefix."""
        ...

    def import_sequence(self, seq_id: int, state: bytes) -> None:
        """Replace a sequence's KV with what `export_sequence` gave."""
        ...

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> Constraint:
        """The grammar `text` as a sampling constraint (`serving/sampling.py`); with a
        `trigger`, from the first match of that regular expression on; with `close_within`,
        a JSON grammar whose text must be whole within that many tokens."""
        ...

    def memory_bytes(self) -> int: ...

    def close(self) -> None: ...
