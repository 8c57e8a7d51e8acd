"""Grammar-constrained sampling with llama.cpp's grammar sampler: a `Constraint`
(`serving/sampling.py`) over a model's vocabulary from GBNF text.

llama.cpp aborts the process when a grammar is made to accept a token it does not allow, or
an end of generation before it is complete, so `accept` checks first and raises instead.
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from meshagent.errors import EngineError

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


def _init(vocab: ctypes.c_void_p, text: str, trigger: str | None) -> ctypes.c_void_p:
    if trigger is None:
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode(), b"root")
    else:
        # Lazy: free text until the output matches `trigger`; from the match on, the grammar.
        patterns = (ctypes.c_char_p * 1)(trigger.encode())
        no_tokens = (llama_cpp.llama_token * 1)()
        sampler = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
            vocab, text.encode(), b"root", patterns, 1, no_tokens, 0
        )
    if not sampler:
        raise EngineError("the grammar does not parse (llama.cpp's log says where)")
    return sampler


def check_grammar(vocab: ctypes.c_void_p, text: str, trigger: str | None = None) -> None:
    """Raise EngineError if llama.cpp refuses `text` as a grammar over `vocab`."""
    llama_cpp.llama_sampler_free(_init(vocab, text, trigger))


class GrammarConstraint:
    """The tokens of `vocab` that the GBNF grammar `text` (rule `root`) allows next; with a
    `trigger` (a regular expression), any token until the output matches it, then what the
    grammar allows from the match on."""

    def __init__(
        self, vocab: ctypes.c_void_p, n_vocab: int, text: str, trigger: str | None = None
    ) -> None:
        self._sampler = _init(vocab, text, trigger)
        self._n = n_vocab
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    def _apply(self, data: np.ndarray) -> np.ndarray:
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        return data[: array.size]

    def allows(self, token: int) -> bool:
        self._one["id"], self._one["logit"] = token, 0.0
        out = self._apply(self._one)
        return len(out) == 1 and bool(np.isfinite(out["logit"][0]))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        data = self._all
        data["id"] = np.arange(self._n)
        data["logit"] = logits[: self._n]
        data["p"] = 0.0
        out = self._apply(data)
        masked = np.full(len(logits), -np.inf, dtype=np.float32)
        masked[out["id"]] = out["logit"]
        return masked

    def accept(self, token: int) -> None:
        if not self.allows(token):
            raise EngineError(f"token {token} does not follow the grammar here")
        llama_cpp.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
