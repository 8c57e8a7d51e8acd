"""A model's vocabulary: tokenizing, token bytes, special tokens, chat template."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp

from meshagent.engine.base import check_tokens
from meshagent.engine.grammar import GrammarConstraint, TokenTables, check_grammar
from meshagent.engine.runtime import load_model


class Vocab:
    def __init__(self, model: ctypes.c_void_p, *, owned: bool = False) -> None:
        self._model = model
        self._owned = owned
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._bytes: dict[int, bytes] = {}
        self._tables: TokenTables | None = None  # built for the first JSON that must close

    @classmethod
    def load(cls, path: Path) -> Vocab:
        """Only the vocabulary of a GGUF (no weights are loaded)."""
        return cls(load_model(path, vocab_only=True), owned=True)

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """`special`: text such as `<|im_start|>` becomes its control token (a rendered chat
        template); otherwise it stays plain text (input that is only text)."""
        data = text.encode()
        cap = len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def token_bytes(self, token: int) -> bytes:
        cached = self._bytes.get(token)
        if cached is None:
            check_tokens((token,), self.n_vocab)
            # A buffer of its own each time: threads other than the event loop's ask too (a
            # draft model's worker, across tokenizers), and llama.cpp writes it without the GIL.
            size = 256
            while True:
                piece = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, piece, size, 0, False)
                if n >= 0:
                    break
                size = -n  # (it says how much a longer piece needs)
            cached = piece.raw[:n]
            self._bytes[token] = cached
        return cached

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def check_grammar(self, text: str, trigger: str | None = None) -> None:
        """Raise EngineError if `text` is not a grammar llama.cpp accepts."""
        check_grammar(self._vocab, text, trigger)

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> GrammarConstraint:
        """The grammar `text` as a sampling constraint over this vocabulary; with
        `close_within`, a JSON grammar whose text must be whole within that many tokens."""
        tables = None
        if close_within is not None:
            if self._tables is None:
                self._tables = TokenTables(
                    self.n_vocab, self.token_bytes, self.is_end_of_generation
                )
            tables = self._tables
        return GrammarConstraint(
            self._vocab, self.n_vocab, text, trigger, close_within=close_within, tables=tables
        )

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""  # (no such token: a model without BOS says -1)
        check_tokens((token,), self.n_vocab)
        raw = llama_cpp.llama_vocab_get_text(self._vocab, token)
        return raw.decode(errors="replace") if raw else ""

    @property
    def bos_token(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_eos(self._vocab))

    def fim(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle), where the vocabulary has
        them (llama.cpp finds them by their text: Qwen's, StarCoder's, CodeLlama's...)."""
        v = self._vocab
        ids = (
            llama_cpp.llama_vocab_fim_pre(v),
            llama_cpp.llama_vocab_fim_suf(v),
            llama_cpp.llama_vocab_fim_mid(v),
        )
        return ids if all(0 <= t < self.n_vocab for t in ids) else None

    def chat_template(self) -> str | None:
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return raw.decode() if raw else None

    def close(self) -> None:
        if self._owned and self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None


class VocabDelegate:
    """The tokenizer half of the `Engine` interface, answered by a `Vocab`."""

    vocab: Vocab

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        return self.vocab.tokenize(text, add_bos=add_bos)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocab.is_end_of_generation(token)

    def check_grammar(self, text: str, trigger: str | None = None) -> None:
        self.vocab.check_grammar(text, trigger)

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> GrammarConstraint:
        return self.vocab.constraint(text, trigger, close_within)
