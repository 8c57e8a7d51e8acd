"""A fake model for tests: deterministic logits from token ids, in microseconds.

The next-token logits of a sequence are a function of every token it holds and their
positions, so a scheduler or executor that feeds a token twice, skips one, or mixes up two
sequences' caches changes the text. Every call checks that a sequence's tokens arrive at the
position its cache has reached, and raises otherwise. `delay` (seconds per forward, plus
`token_delay` per token for `FakeEngine`) stands in for compute time. With
`batch_sensitive`, the logits also depend on how a sequence's tokens were batched (how many
ran in each forward call), by less than it takes to change the favourite: like llama.cpp,
whose last bits change with a batch's shape, greedy text stays the same while a sampled one
may not.

Three shapes share that arithmetic, so a split on fakes must give exactly what the whole
fake gives: `FakeEngine` (a whole model, the `Engine` interface), `FakeEntry` (the entry of
a split: text side and first stage) and `FakeStage` (any later stage; hidden rows carry the
token ids and positions, and the last stage turns them into logits).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from meshagent.engine.base import ForwardItem, ModelInfo
from meshagent.engine.runtime import EmbdItem
from meshagent.engine.stage import StageOutput
from meshagent.errors import EngineError

EOS = 0
BOS = 1
WIDTH = 4  # hidden row: token id, position, then padding
STATE_BYTES = 64  # bytes per token of an exported sequence (padding past its content)


class FakeConstraint:
    """A fake grammar: `fake:` and then the texts allowed, separated by `|` (a finite
    language over the fake letters and spaces). A token is allowed while the text so far
    with it is a prefix of one of them; the end only once the text is one of them."""

    def __init__(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> None:
        if trigger is not None or close_within is not None:
            raise EngineError("fake grammars hold from the first token and close by themselves")
        self.words = parse_fake_grammar(text)
        self.text = ""

    def _after(self, token: int) -> str | None:
        if token == EOS:
            return None
        return self.text + fake_token_bytes(token).decode()

    def allows(self, token: int) -> bool:
        after = self._after(token)
        if after is None:
            return self.text in self.words
        return any(w.startswith(after) for w in self.words) and after != self.text

    def mask(self, logits: np.ndarray) -> np.ndarray:
        allowed = np.array([self.allows(t) for t in range(len(logits))])
        return np.where(allowed, logits, -np.inf).astype(np.float32)

    def accept(self, token: int) -> None:
        if not self.allows(token):
            raise EngineError(f"token {token} does not follow the grammar here")
        after = self._after(token)
        if after is not None:
            self.text = after


def fake_token_bytes(token: int) -> bytes:
    if token < 2:
        return b""
    return bytes([ord("a") + token - 2]) if token < 28 else b" "


def parse_fake_grammar(text: str) -> tuple[str, ...]:
    if not text.startswith("fake:") or not text[5:]:
        raise EngineError("a fake grammar is 'fake:' and then texts separated by '|'")
    return tuple(text[5:].split("|"))


class FakeVocab:
    """Token 0 ends generation, 1 begins text, 2.. are the letters a-z and the rest spaces."""

    def __init__(self, n_vocab: int = 40, *, slots: int = 4, slot_ctx: int = 256) -> None:
        if n_vocab < 28:
            raise ValueError("a fake vocabulary needs at least 28 tokens")
        self.n_vocab = n_vocab
        self.n_slots = slots
        self.slot_ctx = slot_ctx
        self.info = ModelInfo(
            id="fake",
            path="",
            architecture="fake",
            n_layers=3,
            n_vocab=n_vocab,
            n_ctx_train=slot_ctx,
            size_bytes=0,
            chat_template=None,
            bos_token="<s>",
            eos_token="</s>",
        )

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        ids = [2 + (ord(c) - ord("a")) if "a" <= c <= "z" else 28 for c in text.lower()]
        return ([BOS] if add_bos else []) + [min(t, self.n_vocab - 1) for t in ids]

    def token_bytes(self, token: int) -> bytes:
        return fake_token_bytes(token)

    def is_end_of_generation(self, token: int) -> bool:
        return token == EOS

    def check_grammar(self, text: str, trigger: str | None = None) -> None:
        parse_fake_grammar(text)

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> FakeConstraint:
        return FakeConstraint(text, trigger, close_within)


class _Caches:
    """What each slot holds: (token, position) pairs, checked as they arrive."""

    def __init__(self, slots: int, slot_ctx: int) -> None:
        self.slot_ctx = slot_ctx
        self.held: list[list[int]] = [[] for _ in range(slots)]
        # Per slot, [call, tokens] for each forward call that added to it: the batch shapes.
        self.shapes: list[list[list[int]]] = [[] for _ in range(slots)]

    def add(self, slot: int, pos: int, tokens: Sequence[int], call: int = 0) -> None:
        held = self.held[slot]
        if pos != len(held):
            raise EngineError(f"slot {slot} holds {len(held)} tokens, got a token at {pos}")
        if pos + len(tokens) > self.slot_ctx:
            raise EngineError(f"slot {slot} overflows its {self.slot_ctx} tokens")
        held.extend(int(t) for t in tokens)
        shape = self.shapes[slot]
        if shape and shape[-1][0] == call:
            shape[-1][1] += len(tokens)
        else:
            shape.append([call, len(tokens)])

    def batches(self, slot: int) -> tuple[int, ...]:
        """How many of the slot's tokens ran in each forward call, in order."""
        return tuple(n for _, n in self.shapes[slot])

    def clear(self, slot: int) -> None:
        self.held[slot] = []
        self.shapes[slot] = []

    def trim(self, slot: int, keep: int) -> None:
        del self.held[slot][keep:]
        kept, left = [], keep
        for call, n in self.shapes[slot]:
            if left <= 0:
                break
            kept.append([call, min(n, left)])
            left -= n
        self.shapes[slot] = kept


def fake_logits(
    held: Sequence[int],
    n_vocab: int,
    *,
    eos_every: int = 0,
    batches: tuple[int, ...] | None = None,
    copy_back: int = 0,
) -> np.ndarray:
    """Logits after a sequence holding `held`: a clear favourite that depends on all of it,
    and a spread that lets temperature sampling wander. With `eos_every`, the end token is
    the favourite at every `eos_every`-th position. With `batches` (how the tokens were
    batched), every other token moves by up to 1, the favourite stays. With `copy_back`, the
    favourite is the token that many back (copy-shaped text: it repeats itself)."""
    h = 0
    for t in held:
        h = (h * 31 + t + 7) % 1_000_003
    favourite = 2 + h % (n_vocab - 2)
    if copy_back and len(held) >= copy_back:
        favourite = held[-copy_back]
    if eos_every and len(held) % eos_every == 0:
        favourite = EOS
    ids = np.arange(n_vocab, dtype=np.float32)
    logits = -((ids - favourite) % n_vocab) * 0.5
    if batches is not None:
        logits += np.random.default_rng(batches).uniform(-1, 1, n_vocab).astype(np.float32)
    logits[favourite] = 4.0
    return logits


class _FakeCompute:
    """The compute side every fake shares: per-slot caches, a delay, a count of calls."""

    def __init__(
        self,
        *,
        n_vocab: int,
        slots: int,
        slot_ctx: int,
        delay: float,
        eos_every: int,
        batch_sensitive: bool = False,
        copy_back: int = 0,
    ) -> None:
        self.batch_sensitive = batch_sensitive
        self.copy_back = copy_back
        self.n_vocab = n_vocab
        self.n_slots = slots
        self.slot_ctx = slot_ctx
        self.caches = _Caches(slots, slot_ctx)
        self.delay = delay
        self.token_delay = 0.0  # seconds per token on top of `delay`: compute-bound windows
        self.eos_every = eos_every
        self.forwards = 0
        self.fail_next: str | None = None  # the next call raises this

    def _compute(self, tokens: int = 1) -> None:
        if self.fail_next is not None:
            why, self.fail_next = self.fail_next, None
            raise EngineError(why)
        if self.delay or self.token_delay:
            time.sleep(self.delay + self.token_delay * tokens)
        self.forwards += 1

    def _run(self, slot: int, pos: int, tokens: Sequence[int], want: bool) -> np.ndarray | None:
        """Add the tokens to the slot's cache; the logits after them if `want`."""
        self.caches.add(slot, pos, tokens, self.forwards)
        if not want:
            return None
        batches = self.caches.batches(slot) if self.batch_sensitive else None
        return fake_logits(
            self.caches.held[slot],
            self.n_vocab,
            eos_every=self.eos_every,
            batches=batches,
            copy_back=self.copy_back,
        )

    def clear_sequence(self, seq_id: int) -> None:
        self.caches.clear(seq_id)

    def trim_sequence(self, seq_id: int, keep: int) -> None:
        self.caches.trim(seq_id, keep)

    def export_sequence(self, seq_id: int, keep: int) -> bytes:
        """The held tokens and their batch shapes, `STATE_BYTES` per token (as a real
        cache's bytes grow with its tokens)."""
        self.caches.trim(seq_id, keep)
        held, shapes = self.caches.held[seq_id], self.caches.shapes[seq_id]
        flat = [len(held), *held, *(x for shape in shapes for x in shape)]
        return np.array(flat, dtype="<i8").tobytes().ljust(STATE_BYTES * len(held), b"\0")

    def import_sequence(self, seq_id: int, state: bytes) -> None:
        words = np.frombuffer(state[: len(state) // 8 * 8], dtype="<i8")
        n = int(words[0])
        self.caches.held[seq_id] = [int(t) for t in words[1 : 1 + n]]
        shapes, left = [], n
        rest = words[1 + n :]
        for call, k in rest[: len(rest) // 2 * 2].reshape(-1, 2):
            if left <= 0:
                break
            shapes.append([int(call), int(k)])
            left -= int(k)
        self.caches.shapes[seq_id] = shapes


class FakeEngine(FakeVocab, _FakeCompute):
    """A whole fake model (the `Engine` interface)."""

    rewindable = True

    def __init__(
        self,
        n_vocab: int = 40,
        *,
        slots: int = 4,
        slot_ctx: int = 256,
        delay: float = 0.0,
        eos_every: int = 0,
        batch_sensitive: bool = False,
        copy_back: int = 0,
    ) -> None:
        FakeVocab.__init__(self, n_vocab, slots=slots, slot_ctx=slot_ctx)
        _FakeCompute.__init__(
            self,
            n_vocab=n_vocab,
            slots=slots,
            slot_ctx=slot_ctx,
            delay=delay,
            eos_every=eos_every,
            batch_sensitive=batch_sensitive,
            copy_back=copy_back,
        )

    def forward(self, items: Sequence[ForwardItem]) -> list[np.ndarray | None]:
        self._compute(sum(len(it.tokens) for it in items))
        out: list[np.ndarray | None] = []
        for it in items:
            if it.want_logits and it.rows > 1:  # a window: logits after each of its last tokens
                head = len(it.tokens) - it.rows
                self._run(it.seq_id, it.pos, it.tokens[:head], False)
                rows = [
                    self._run(it.seq_id, it.pos + i, it.tokens[i : i + 1], True)
                    for i in range(head, len(it.tokens))
                ]
                out.append(np.stack(rows))
            else:
                out.append(self._run(it.seq_id, it.pos, it.tokens, it.want_logits))
        return out

    def reset(self) -> None:
        for slot in range(self.n_slots):
            self.caches.clear(slot)

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class FakeEntry(FakeVocab, _FakeCompute):
    """The entry of a fake split: text side, plus a first stage that checks positions and
    encodes each token as a hidden row (token id, position)."""

    end_layer: int | None = None  # fakes have no layers: stages check nothing
    rewindable = True
    exact_windows = True  # its stages compute a window's rows one by one, as steps
    windows_reason = "a fake split: rows computed one by one"

    def __init__(
        self, n_vocab: int = 40, *, slots: int = 4, slot_ctx: int = 256, delay: float = 0.0
    ) -> None:
        FakeVocab.__init__(self, n_vocab, slots=slots, slot_ctx=slot_ctx)
        _FakeCompute.__init__(
            self, n_vocab=n_vocab, slots=slots, slot_ctx=slot_ctx, delay=delay, eos_every=0
        )

    def run_first(self, items: Sequence[tuple[int, int, list[int]]]) -> list[np.ndarray]:
        self._compute(sum(len(tokens) for _, _, tokens in items))
        rows = []
        for slot, pos, tokens in items:
            self._run(slot, pos, tokens, False)
            rows.append(_rows(tokens, pos))
        return rows


def _rows(tokens: Sequence[int], pos: int) -> np.ndarray:
    out = np.zeros((len(tokens), WIDTH), dtype=np.float32)
    out[:, 0] = tokens
    out[:, 1] = np.arange(pos, pos + len(tokens))
    return out


class FakeStage(_FakeCompute):
    """A later stage of a fake split (what `StageServer` needs of a `StageEngine`)."""

    def __init__(
        self,
        *,
        last: bool,
        n_vocab: int = 40,
        slots: int = 4,
        slot_ctx: int = 256,
        delay: float = 0.0,
        eos_every: int = 0,
        batch_sensitive: bool = False,
        copy_back: int = 0,
        max_batch_tokens: int = 512,
    ) -> None:
        super().__init__(
            n_vocab=n_vocab,
            slots=slots,
            slot_ctx=slot_ctx,
            delay=delay,
            eos_every=eos_every,
            batch_sensitive=batch_sensitive,
            copy_back=copy_back,
        )
        self.last = last
        self.n_embd = WIDTH
        self.max_batch_tokens = max_batch_tokens  # as llama.cpp's batch, refused beyond
        # Fakes have no layers: a stage checks a Forward's layer only where both say one.
        self.start: int | None = None
        self.end: int | None = None

    def constraint(
        self, text: str, trigger: str | None = None, close_within: int | None = None
    ) -> FakeConstraint:
        return FakeConstraint(text, trigger, close_within)

    def forward(self, items: Sequence[EmbdItem]) -> StageOutput:
        if (n := sum(len(it.hidden) for it in items)) > self.max_batch_tokens:
            raise EngineError(f"batch of {n} tokens exceeds {self.max_batch_tokens}")
        self._compute(n)
        hidden, logits = [], []
        for it in items:
            rows = np.asarray(it.hidden, dtype=np.float32)
            tokens = [int(t) for t in rows[:, 0]]
            if [int(p) for p in rows[:, 1]] != list(range(it.pos, it.pos + len(tokens))):
                raise EngineError(f"hidden rows of slot {it.seq_id} carry the wrong positions")
            hidden.append(rows)
            want = int(it.want_logits) if self.last else 0
            if want > 1:  # a window: logits after each of its last `want` tokens
                head = len(tokens) - want
                self._run(it.seq_id, it.pos, tokens[:head], False)
                window = [
                    self._run(it.seq_id, it.pos + i, tokens[i : i + 1], True)
                    for i in range(head, len(tokens))
                ]
                logits.append(np.stack(window))
            else:
                logits.append(self._run(it.seq_id, it.pos, tokens, want > 0))
        return StageOutput(None if self.last else hidden, logits)
