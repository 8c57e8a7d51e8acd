"""Cutting a recurrent state back: a checkpoint before each decode of several tokens.

A recurrent or hybrid model's sequence state summarises every token the sequence has seen, so
llama.cpp cannot cut it back to an earlier position. A verify window whose drafts are rejected
must be cut back, though, and so must a sequence kept as a prefix past a rejected tail. So,
before a runtime of such a model decodes several tokens of a sequence in one go (a verify
window, a prompt chunk), it keeps the sequence's recurrent state and that decode's input.
Cutting the sequence back into that decode loads the state again, removes the KV cells past
it (a hybrid's attention layers) and decodes the kept part of the input once more: the
sequence then holds what it would hold had only those tokens run.

One checkpoint per sequence, the last; its bytes count in the engine's memory.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp
import numpy as np

from meshagent.errors import EngineError

# llama.cpp's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a hybrid's recurrent cells without its KV.
PARTIAL_ONLY = 1


@dataclass(frozen=True)
class Checkpoint:
    pos: int  # the sequence's length when it was taken
    end: int  # its length after the decode that followed
    state: bytes | None  # its recurrent state then; None: the sequence was empty
    inputs: tuple[int, ...] | np.ndarray  # that decode's tokens or hidden-state rows

    @property
    def nbytes(self) -> int:
        held = self.inputs.nbytes if isinstance(self.inputs, np.ndarray) else 8 * len(self.inputs)
        return len(self.state or b"") + held

    def covers(self, length: int, keep: int) -> bool:
        """Whether a sequence of `length` positions can be cut back to `keep` from here."""
        return self.end == length and self.pos <= keep <= self.end


def read_state(ctx: llama_cpp.llama_context_p, seq_id: int) -> bytes:
    """The recurrent part of a sequence's state, as llama.cpp serialises it."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, seq_id, PARTIAL_ONLY))
    buf = (ctypes.c_uint8 * size)()
    n = int(llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, PARTIAL_ONLY))
    if n == 0:
        raise EngineError(f"llama.cpp could not save the state of sequence {seq_id}")
    return bytes(buf)[:n]


def write_state(ctx: llama_cpp.llama_context_p, seq_id: int, state: bytes) -> None:
    """Load `read_state`'s bytes back into a sequence's recurrent part."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    if not llama_cpp.llama_state_seq_set_data_ext(ctx, buf, len(state), seq_id, PARTIAL_ONLY):
        raise EngineError(f"llama.cpp could not load a saved state into sequence {seq_id}")
