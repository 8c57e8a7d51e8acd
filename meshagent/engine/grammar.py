"""Grammar-constrained sampling with llama.cpp's grammar sampler: a `Constraint`
(`serving/sampling.py`) over a model's vocabulary from GBNF text.

llama.cpp aborts the process when a grammar is made to accept a token it does not allow, or
an end of generation before it is complete, so `accept` checks first and raises instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import llama_cpp
import numpy as np

from meshagent.engine.base import check_tokens
from meshagent.engine.gbnf_close import GbnfCloser, Grammar
from meshagent.engine.json_close import JsonCloser
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


# Tokens before the end that a JSON object starts closing: more than any one token adds to
# the text that closes it (`{"` adds `":null}`).
APPROACH = 16


class TokenTables:
    """What closing JSON needs of a vocabulary: each token's bytes, the tokens by first byte,
    those that are plain string content (no quote, backslash or control byte), and the ends
    of generation."""

    def __init__(
        self, n_vocab: int, token_bytes: Callable[[int], bytes], is_end: Callable[[int], bool]
    ) -> None:
        self.bytes = [token_bytes(t) for t in range(n_vocab)]
        self.plain = np.array(
            [bool(b) and not any(x in b'"\\' or x < 0x20 for x in b) for b in self.bytes]
        )
        by_first: dict[int, list[int]] = {}
        for t, b in enumerate(self.bytes):
            if b and not is_end(t):
                by_first.setdefault(b[0], []).append(t)
        self.by_first = {k: np.array(v) for k, v in by_first.items()}
        self.ends = np.array([t for t in range(n_vocab) if is_end(t)], dtype=np.int64)
        self._fewest: dict[bytes, list[int]] = {}

    def fewest(self, text: bytes) -> list[int]:
        """For each offset i of `text`, the fewest tokens that write text[i:] (a large number
        where none can). Kept for the last few texts: a closing often stays the same from
        one step to the next (inside a string)."""
        found = self._fewest.get(text)
        if found is None:
            if len(self._fewest) >= 64:
                self._fewest.clear()
            found = self._fewest[text] = self._count_fewest(text)
        return found

    def _count_fewest(self, text: bytes) -> list[int]:
        n = len(text)
        best = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            options = [best[i + len(self.bytes[t])] for t in self.prefixes(text[i:])]
            best[i] = 1 + min(options) if options else 1 << 30
        return best

    def prefixes(self, text: bytes) -> np.ndarray:
        """The tokens whose bytes begin `text`."""
        if not text:
            return self.ends
        ids = self.by_first.get(text[0])
        if ids is None:
            return np.zeros(0, dtype=np.int64)
        return np.array([t for t in ids if text.startswith(self.bytes[t])], dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _read(text: str) -> Grammar | None:
    """The grammar as the closer follows it (read once per text), or None where it cannot."""
    try:
        return Grammar(text)
    except (ValueError, IndexError, RecursionError):
        return None


def closer_for(text: str) -> JsonCloser | GbnfCloser | None:
    """What tracks the shortest closing of output under grammar `text`: the JSON closer for
    any-JSON grammars (it lets string content run on near the end), else the grammar's own
    (`engine/gbnf_close.py`); None for a grammar the closer cannot read."""
    if text.startswith(JSON_GRAMMAR_MARK):
        return JsonCloser()
    grammar = _read(text)
    return None if grammar is None else GbnfCloser(grammar)


# The first line of `api/structured.json_grammar`: any JSON object.
JSON_GRAMMAR_MARK = "root ::= object-1\n"


class GrammarConstraint:
    """The tokens of `vocab` that the GBNF grammar `text` (rule `root`) allows next; with a
    `trigger` (a regular expression), any token until the output matches it, then what the
    grammar allows from the match on."""

    def __init__(
        self,
        vocab: ctypes.c_void_p,
        n_vocab: int,
        text: str,
        trigger: str | None = None,
        *,
        close_within: int | None = None,
        tables: TokenTables | None = None,
    ) -> None:
        self._sampler = _init(vocab, text, trigger)
        self._n = n_vocab
        self._all = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        # Text that must be whole within `close_within` tokens (`engine/json_close.py`,
        # `engine/gbnf_close.py`). Not for a lazy grammar: it holds only once triggered.
        closer = closer_for(text) if close_within is not None and trigger is None else None
        self._close_within = close_within if closer is not None else None
        self._tables = tables
        self._closer = closer
        self._count = 0  # tokens accepted (of text: an end is never followed by more)
        self._closing: tuple[int, np.ndarray | None] | None = None  # (count, allowed)
        self._allowed: tuple[int, int] | None = None  # (count, token) `allows` said yes to
        # (count, token, the closer fed it) as `_fits` left it: `accept` takes it up.
        self._fed: tuple[int, int, JsonCloser | GbnfCloser] | None = None

    def _closing_set(self) -> np.ndarray | None:
        """The tokens allowed now by the need to close in time (None: any)."""
        if self._closer is None or self._close_within is None or self._tables is None:
            return None
        if self._closing is not None and self._closing[0] == self._count:
            return self._closing[1]
        closing = self._closer.closing().encode()
        left = self._close_within - 1 - self._count  # tokens of text before the last, an end
        allowed: np.ndarray | None = None
        if left <= len(closing) + APPROACH:
            allowed = self._tables.prefixes(closing)
            if closing:
                # Of the tokens that write the closing, those after which the rest still fits
                # the tokens left (or, where none does, those that come closest).
                fewest = self._tables.fewest(closing)
                after = np.array([fewest[len(self._tables.bytes[t])] for t in allowed])
                fit = after <= left - 1
                allowed = allowed[fit] if fit.any() else allowed[after == after.min()]
            if left > len(closing) and self._closer.in_string:
                allowed = np.union1d(allowed, np.flatnonzero(self._tables.plain))
        self._closing = (self._count, allowed)
        return allowed

    def _apply(self, data: np.ndarray) -> np.ndarray:
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=len(data),
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        return data[: array.size]

    def _fits(self, token: int) -> bool:
        """Whether the closing text still fits the tokens left after `token` (one character a
        token at worst), where no closing set holds yet: a token may open what must close."""
        if self._closer is None or self._close_within is None or self._tables is None:
            return True
        after = self._closer.copy()
        after.feed(self._tables.bytes[token])
        self._fed = (self._count, token, after)
        left = self._close_within - 2 - self._count  # after this token, before the end
        return len(after.closing().encode()) <= left

    def allows(self, token: int) -> bool:
        return self._allows(token, fit=True)

    def _allows(self, token: int, *, fit: bool) -> bool:
        check_tokens((token,), self._n)
        closing = self._closing_set()
        if closing is not None and token not in closing:
            return False
        if fit and closing is None and not self._fits(token):
            return False
        self._one["id"], self._one["logit"] = token, 0.0
        out = self._apply(self._one)
        ok = len(out) == 1 and bool(np.isfinite(out["logit"][0]))
        if ok:
            self._allowed = (self._count, token)
        return ok

    def mask(self, logits: np.ndarray) -> np.ndarray:
        data = self._all
        data["id"] = np.arange(self._n)
        data["logit"] = logits[: self._n]
        data["p"] = 0.0
        out = self._apply(data)
        masked = np.full(len(logits), -np.inf, dtype=np.float32)
        masked[out["id"]] = out["logit"]
        closing = self._closing_set()
        if closing is not None:
            keep = np.full(len(logits), -np.inf, dtype=np.float32)
            keep[closing] = masked[closing]
            masked = keep
        return masked

    def accept(self, token: int) -> None:
        # The sampler asked `allows` of this very token already, unless it drew from a mask
        # (which may hold a token that opens more than fits: rare, and no grounds to fail).
        if self._allowed != (self._count, token) and not self._allows(token, fit=False):
            raise EngineError(f"token {token} does not follow the grammar here")
        llama_cpp.llama_sampler_accept(self._sampler, token)
        if self._fed is not None and self._fed[:2] == (self._count, token):
            self._closer = self._fed[2]  # fed this very token already, to see it fits
        elif self._closer is not None and self._tables is not None:
            self._closer.feed(self._tables.bytes[token])
        self._fed = None
        self._count += 1

    def close(self) -> None:
        if self._sampler:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
