"""Messages between the stages of a split model (sans-IO).

A message is `u32 header length (little-endian) | cbor header | payload`. Headers are cbor
maps with small integer keys and a version; activations travel as the payload in raw
little-endian f16 or f32, never as cbor arrays. `StageDecoder` is fed bytes and returns
messages, raising `StageProtocolError` on anything malformed or out of range.

A receiver decodes against `StageLimits`, what it knows of itself: its slots, their context,
the vocabulary and the hidden width. Every value a peer sends is checked there, once, before
any of it reaches the engine (llama.cpp aborts the process on a sequence id past its slots),
and each message type's payload is capped by what that type can hold before a byte of it is
buffered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cbor2
import numpy as np

from meshagent.errors import MeshError
from meshagent.serving.sampling import SEEDS, SamplingParams, TokenLogprob, seed_word
from meshagent.wire.framing import Framing, LengthPrefixDecoder
from meshagent.wire.quoted import quoted

VERSION = 1
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024  # whatever the limits, no message carries more
MAX_ID = 2**63 - 1  # prefix-cache entries, layers, seeds: any id the sender's counters reach
MAX_TOKEN = 2**31 - 1  # token ids (llama.cpp's are int32), and so counts of them
DTYPES = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4")}

# header keys
K_VERSION, K_TYPE, K_SEQ, K_SAMPLING, K_ITEMS, K_DTYPE, K_WIDTH, K_TOKEN, K_ERROR, K_SIZE = range(
    10
)
K_TIMING = 10  # milliseconds each stage spent on the batch, in pipeline order
K_HISTORY = 11  # Open: the completion's tokens so far (a replay), u32 payload of K_SIZE bytes
K_LAYER = 12  # Forward: the first layer its rows are input to (the sender's end layer)
K_MORE = 13  # Token: the tokens a verified draft adds after `token`
K_ENTRY = 14  # Keep: the kept prefix's entry id
K_LENGTH = 15  # Keep: how many leading positions of the sequence it holds
K_RESTORE = 16  # Open: [entry, n], start from that kept prefix's first n positions
K_ENTRIES = 17  # Drop: the entries to free
K_LOGPROBS = 18  # Token: per token, [logprob, [[id, logprob], ...]] (where asked for)
K_MOVE = 19  # Moved, Continue: the move's id, the same in both
MAX_TOP_LOGPROBS = 20
MAX_STAGES = 64
T_OPEN, T_FORWARD, T_CLOSE, T_TOKEN, T_ERROR, T_KEEP, T_DROP = 1, 2, 3, 4, 5, 6, 7
T_MOVED, T_CONTINUE = 8, 9
# What each kind of stream carries: upstream, the entry's messages (a failure only from a
# middle stage, to say why it stopped); back to the entry, tokens and failures. Either kind
# moves to a new stream when its connection is replaced (`serving/moving.py`).
UPSTREAM = frozenset({T_OPEN, T_FORWARD, T_CLOSE, T_ERROR, T_KEEP, T_DROP, T_MOVED, T_CONTINUE})
REPLIES = frozenset({T_TOKEN, T_ERROR, T_MOVED, T_CONTINUE})


class StageProtocolError(MeshError):
    """A malformed stage message: the stream it came on is closed."""


@dataclass(frozen=True)
class StageLimits:
    """What a receiver holds, which every value in its stage messages must fit: `slots`
    sequences of `slot_ctx` positions each, token ids below `n_vocab`, hidden rows `width`
    wide. Without a width the stream is one back to the entry (tokens and failures only)."""

    slots: int
    slot_ctx: int
    n_vocab: int
    width: int | None = None

    @property
    def accepts(self) -> frozenset[int]:
        return REPLIES if self.width is None else UPSTREAM

    def seq(self, seq: int) -> int:
        if seq >= self.slots:
            raise StageProtocolError(f"sequence {quoted(seq)} is not one of the {self.slots} slots")
        return seq

    def span(self, seq: int, pos: int, n: int) -> None:
        """Positions pos..pos+n-1 of a sequence: within its slot."""
        self.seq(seq)
        if pos + n > self.slot_ctx:
            raise StageProtocolError(
                f"positions {quoted(pos)}-{quoted(pos + n - 1)} of sequence {seq} are past "
                f"its slot's {self.slot_ctx} positions"
            )

    def tokens(self, ids: Any, what: str) -> tuple[int, ...]:
        """`ids`, a list of token ids of the vocabulary (at most a slot's worth)."""
        ok = isinstance(ids, list | tuple) and len(ids) <= self.slot_ctx
        if not ok or not all(_uint(x) and x < self.n_vocab for x in ids):
            raise StageProtocolError(
                f"{what} must be at most {self.slot_ctx} token ids below {self.n_vocab}"
            )
        return tuple(ids)

    def rows(self) -> int:
        """The most hidden rows a Forward may carry: every slot's context, full (and no more
        than `MAX_PAYLOAD` holds)."""
        return min(self.slots * self.slot_ctx, MAX_PAYLOAD // (4 * (self.width or 1)))


# Only the header is framed (little-endian, unlike the other framings); the payload follows
# it as is, its size in the header.
FRAMING = Framing(
    "stage header", width=4, max_size=MAX_HEADER, byteorder="little", error=StageProtocolError
)


@dataclass(frozen=True)
class Open:
    """A sequence starts: the last stage creates its sampler with these parameters. A
    sequence replayed after a lost stage carries the tokens it has generated so far (the
    sampler continues from them)."""

    seq: int
    sampling: SamplingParams
    history: tuple[int, ...] = ()
    # (entry, n): every stage loads its kept prefix `entry` into the sequence and keeps its
    # first n positions (`Keep`); the entry sends only the positions after them.
    restore: tuple[int, int] | None = None


@dataclass(frozen=True)
class Keep:
    """Every stage keeps its KV of the sequence's first `length` positions as prefix-cache
    `entry` (sent before the sequence's `Close`)."""

    seq: int
    entry: int
    length: int


@dataclass(frozen=True)
class Drop:
    """Every stage frees these kept prefixes."""

    entries: tuple[int, ...]


@dataclass(frozen=True)
class ForwardItem:
    seq: int
    pos: int
    n: int
    sample: bool  # the last stage samples a token after the item's last row
    # A draft to verify: the item's last len(draft) tokens, which the last stage checks
    # against what it samples after each of the rows before them (docs/speculation.md).
    draft: tuple[int, ...] = ()
    # A window sent before the verdict on the one before it: all its tokens are the draft,
    # the first a guess at the token that window ends with. Void unless it was (the last
    # stage then samples nothing for it).
    follows: bool = False


@dataclass(frozen=True)
class Forward:
    """Hidden states of several sequences' tokens, rows in item order."""

    items: tuple[ForwardItem, ...]
    hidden: np.ndarray  # [sum n, width], f16 or f32
    timing: tuple[float, ...] = ()  # ms each stage so far spent on this batch
    # The first layer these rows are input to: a stage that does not start there belongs to
    # another plan (the mesh replanned while the chain was being opened) and refuses them.
    layer: int | None = None


@dataclass(frozen=True)
class Close:
    seq: int


@dataclass(frozen=True)
class Token:
    seq: int
    token: int
    timing: tuple[float, ...] = ()  # ms each stage spent on the batch that produced it
    more: tuple[int, ...] = ()  # a verified draft: the tokens after `token`, in order
    # Where the sequence asked for them: the log-probability of `token`, then of each of
    # `more` (the last stage computes them from the logits it sampled from).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class StageFailure:
    seq: int | None
    message: str


@dataclass(frozen=True)
class Moved:
    """The last message of a stream whose connection was replaced: what follows comes on
    the stream from the same peer that starts with `Continue(move)`."""

    move: int


@dataclass(frozen=True)
class Continue:
    """The first message of a stream that carries on the one that ended with `Moved(move)`."""

    move: int


Message = Open | Forward | Close | Token | StageFailure | Keep | Drop | Moved | Continue


def _sampling_to_cbor(p: SamplingParams) -> dict[int, Any]:
    seed = None if p.seed is None else seed_word(p.seed)  # as it samples, whatever its sign
    d = {0: p.temperature, 1: p.top_p, 2: seed, 3: p.presence_penalty, 4: p.frequency_penalty}
    if p.grammar is not None:  # both omitted when unset: the map is the bytes it always was
        d[5] = p.grammar
    if p.logprobs is not None:
        d[6] = p.logprobs
    if p.grammar_trigger is not None:
        d[7] = p.grammar_trigger
    if p.close_within is not None:
        d[8] = p.close_within
    if p.top_k:
        d[9] = p.top_k
    if p.repeat_penalty != 1:
        d[10] = p.repeat_penalty
    return d


def _sampling_from_cbor(d: Any) -> SamplingParams:
    if not isinstance(d, dict) or not all(k in d for k in range(5)):
        raise StageProtocolError("sampling parameters must be a map of at least keys 0-4")
    temperature, top_p = _finite(d[0], "temperature"), _finite(d[1], "top_p")
    if temperature < 0 or not 0 < top_p <= 1:
        raise StageProtocolError("a sampling temperature must be >= 0 and top_p in (0, 1]")
    seed = d[2]
    if seed is not None and not (_int_like(seed) and seed in SEEDS):
        raise StageProtocolError(f"a sampling seed must be an integer from 0 to {SEEDS.stop - 1}")
    close_within = _optional(d.get(8), int, "closing budget")
    if close_within is not None and not (_uint(close_within) and 0 < close_within <= MAX_ID):
        raise StageProtocolError("a sampling closing budget must be a positive integer")
    top_k = d.get(9, 0)
    if not (_uint(top_k) and top_k <= MAX_TOKEN):  # (more than the vocabulary: all of it)
        raise StageProtocolError("a sampling top_k must be a count of tokens")
    repeat_penalty = _finite(d.get(10, 1.0), "repeat penalty")
    if repeat_penalty <= 0:
        raise StageProtocolError("a sampling repeat penalty must be positive")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        top_k=top_k,
        repeat_penalty=repeat_penalty,
        presence_penalty=_finite(d[3], "presence penalty"),
        frequency_penalty=_finite(d[4], "frequency penalty"),
        grammar=_optional(d.get(5), str, "grammar"),
        logprobs=_top_count(d.get(6)),
        grammar_trigger=_optional(d.get(7), str, "grammar trigger"),
        close_within=close_within,
    )


def _finite(x: Any, what: str) -> float:
    f = _float(x)
    if f is None or not math.isfinite(f):
        raise StageProtocolError(f"a sampling {what} must be a finite number")
    return f


def _int_like(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _uint(x: Any) -> bool:
    return _int_like(x) and x >= 0


def _optional(value: Any, kind: type, what: str) -> Any:
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise StageProtocolError(f"a sampling {what} must be a {kind.__name__}")
    return value


def _top_count(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise StageProtocolError("a sampling logprobs count must be an integer")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise StageProtocolError(f"a sampling logprobs count must be 0-{MAX_TOP_LOGPROBS}")
    return value


def _logprobs_to_cbor(lps: tuple[TokenLogprob, ...]) -> list[Any]:
    return [[lp.logprob, [[t, v] for t, v in lp.top]] for lp in lps]


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _float(x: Any) -> float | None:
    """`x` as a float, where it is a number a float holds; None otherwise."""
    if not _number(x):
        return None
    try:
        return float(x)
    except OverflowError:  # an integer past 1.8e308
        return None


def _logprobs(h: dict[int, Any], tokens: int, limits: StageLimits) -> tuple[TokenLogprob, ...]:
    raw = h.get(K_LOGPROBS)
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) != tokens:
        raise StageProtocolError("a token's logprobs must be one per token")
    out = []
    for entry in raw:
        ok = isinstance(entry, list) and len(entry) == 2 and _float(entry[0]) is not None
        top = entry[1] if ok else None
        ok = ok and isinstance(top, list) and len(top) <= MAX_TOP_LOGPROBS
        ok = ok and all(
            isinstance(p, list)
            and len(p) == 2
            and _uint(p[0])
            and p[0] < limits.n_vocab
            and _float(p[1]) is not None
            for p in top  # type: ignore[union-attr]
        )
        if not ok:
            raise StageProtocolError(
                "a token's logprob must be [logprob, [[id, logprob]...]], ids of the vocabulary"
            )
        out.append(TokenLogprob(float(entry[0]), tuple((p[0], float(p[1])) for p in top)))
    return tuple(out)


def _item_to_cbor(i: ForwardItem) -> list[Any]:
    # Without a draft an item is the four fields it always was.
    fields: list[Any] = [i.seq, i.pos, i.n, i.sample]
    if i.follows:
        return [*fields, list(i.draft), True]
    return [*fields, list(i.draft)] if i.draft else fields


def _item_from_cbor(it: Any, limits: StageLimits) -> ForwardItem:
    ok = isinstance(it, list) and len(it) in (4, 5, 6) and isinstance(it[3], bool)
    if not ok or not all(_uint(x) for x in it[:3]) or it[2] == 0:
        raise StageProtocolError(f"bad forward item {quoted(it, 80)}")
    limits.span(it[0], it[1], it[2])
    draft: tuple[int, ...] = ()
    follows = len(it) == 6
    if follows and it[5] is not True:
        raise StageProtocolError(f"bad forward item {quoted(it, 80)}")
    if len(it) >= 5:
        d = it[4]
        # A window that follows another is all draft; any other keeps its first token.
        fits = isinstance(d, list) and (len(d) == it[2] if follows else 0 < len(d) < it[2])
        if not fits or not it[3]:
            raise StageProtocolError(f"bad draft in forward item {quoted(it, 80)}")
        draft = limits.tokens(d, "a forward item's draft")
    return ForwardItem(it[0], it[1], it[2], it[3], draft, follows)


def encode(msg: Message) -> bytes:
    payload = b""
    header: dict[int, Any] = {K_VERSION: VERSION}
    if isinstance(msg, Open):
        header |= {K_TYPE: T_OPEN, K_SEQ: msg.seq, K_SAMPLING: _sampling_to_cbor(msg.sampling)}
        if msg.history:  # omitted when empty: a fresh Open is the bytes it always was
            payload = np.asarray(msg.history, dtype="<u4").tobytes()
            header |= {K_HISTORY: True, K_SIZE: len(payload)}
        if msg.restore is not None:
            header[K_RESTORE] = list(msg.restore)
    elif isinstance(msg, Keep):
        header |= {K_TYPE: T_KEEP, K_SEQ: msg.seq, K_ENTRY: msg.entry, K_LENGTH: msg.length}
    elif isinstance(msg, Drop):
        header |= {K_TYPE: T_DROP, K_ENTRIES: list(msg.entries)}
    elif isinstance(msg, Forward):
        dtype = "f16" if msg.hidden.dtype == np.float16 else "f32"
        payload = np.ascontiguousarray(msg.hidden, dtype=DTYPES[dtype]).tobytes()
        header |= {
            K_TYPE: T_FORWARD,
            K_ITEMS: [_item_to_cbor(i) for i in msg.items],
            K_DTYPE: dtype,
            K_WIDTH: int(msg.hidden.shape[1]),
            K_SIZE: len(payload),
            K_TIMING: list(msg.timing),
        }
        if msg.layer is not None:
            header[K_LAYER] = msg.layer
    elif isinstance(msg, Close):
        header |= {K_TYPE: T_CLOSE, K_SEQ: msg.seq}
    elif isinstance(msg, Token):
        header |= {K_TYPE: T_TOKEN, K_SEQ: msg.seq, K_TOKEN: msg.token, K_TIMING: list(msg.timing)}
        if msg.more:
            header[K_MORE] = list(msg.more)
        if msg.logprobs:
            header[K_LOGPROBS] = _logprobs_to_cbor(msg.logprobs)
    elif isinstance(msg, StageFailure):
        header |= {K_TYPE: T_ERROR, K_SEQ: msg.seq, K_ERROR: msg.message}
    elif isinstance(msg, Moved):
        header |= {K_TYPE: T_MOVED, K_MOVE: msg.move}
    elif isinstance(msg, Continue):
        header |= {K_TYPE: T_CONTINUE, K_MOVE: msg.move}
    else:  # pragma: no cover - the type union is closed
        raise TypeError(msg)
    return FRAMING.encode(cbor2.dumps(header)) + payload


Build = Callable[[bytes], Message]  # a checked header's message, given its payload


@dataclass
class StageDecoder:
    """Feed bytes in, take whole messages out, each checked against `limits`. A header is
    checked whole before its payload is waited for, so a payload is never buffered past what
    its message type may carry."""

    limits: StageLimits
    _frames: LengthPrefixDecoder = field(default_factory=lambda: LengthPrefixDecoder(FRAMING))
    _pending: tuple[int, Build] | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        self._frames.feed(data)
        out: list[Message] = []
        while True:
            if self._pending is None:
                raw = self._frames.next_frame()
                if raw is None:
                    return out
                self._pending = _parse(_header(raw), self.limits)
            size, build = self._pending
            payload = self._frames.take(size)
            if payload is None:
                return out
            self._pending = None
            out.append(build(payload))


def _header(raw: bytes) -> dict[int, Any]:
    try:
        h = cbor2.loads(raw)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise StageProtocolError(f"stage header is not cbor: {e}") from e
    if not isinstance(h, dict) or h.get(K_VERSION) != VERSION:
        raise StageProtocolError("stage header of an unknown version or shape")
    return h


def _int(h: dict[int, Any], key: int, what: str) -> int:
    v = h.get(key)
    if not _uint(v) or v > MAX_ID:
        raise StageProtocolError(f"stage message needs a non-negative integer {what}")
    return v


def _size(h: dict[int, Any], cap: int, what: str) -> int:
    """The payload size the header gives: at most `cap` bytes, what `what` may carry."""
    size = h.get(K_SIZE, 0)
    if not _uint(size) or size > cap:
        raise StageProtocolError(f"{what} carries at most {cap} payload bytes, not {quoted(size)}")
    return size


def _timing(h: dict[int, Any]) -> tuple[float, ...]:
    t = h.get(K_TIMING, [])
    if not isinstance(t, list) or len(t) > MAX_STAGES:
        raise StageProtocolError("stage timing must be a short list")
    times = tuple(_float(x) for x in t)
    if not all(x is not None and 0 <= x < math.inf for x in times):
        raise StageProtocolError("stage timing must hold non-negative numbers")
    return times  # type: ignore[return-value]


def _bare(msg: Message) -> Build:
    """A message that carries no payload."""

    def build(payload: bytes) -> Message:
        return msg

    return build


def _parse(h: dict[int, Any], limits: StageLimits) -> tuple[int, Build]:
    """Check a header whole, against `limits`: the size of its payload, and how to make the
    message of it."""
    t = h.get(K_TYPE)
    if not _int_like(t) or t not in limits.accepts:
        what = "to the entry" if limits.width is None else "from upstream"
        raise StageProtocolError(f"stage message type {quoted(t)} does not come {what}")
    if t == T_FORWARD:
        return _parse_forward(h, limits)
    if t == T_OPEN:
        return _parse_open(h, limits)
    _size(h, 0, f"a stage message of type {t}")
    if t == T_KEEP:
        seq, entry = limits.seq(_int(h, K_SEQ, "seq")), _int(h, K_ENTRY, "entry")
        length = _int(h, K_LENGTH, "length")
        if not 0 < length <= limits.slot_ctx:
            raise StageProtocolError(f"a keep's length must be 1-{limits.slot_ctx}")
        return 0, _bare(Keep(seq, entry, length))
    if t == T_DROP:
        entries = h.get(K_ENTRIES)
        ok = isinstance(entries, list) and len(entries) <= MAX_HEADER
        if not ok or not all(_uint(x) and x <= MAX_ID for x in entries):
            raise StageProtocolError("a drop's entries must be non-negative integers")
        return 0, _bare(Drop(tuple(entries)))
    if t == T_CLOSE:
        return 0, _bare(Close(limits.seq(_int(h, K_SEQ, "seq"))))
    if t == T_MOVED:
        return 0, _bare(Moved(_int(h, K_MOVE, "move")))
    if t == T_CONTINUE:
        return 0, _bare(Continue(_int(h, K_MOVE, "move")))
    if t == T_TOKEN:
        seq = limits.seq(_int(h, K_SEQ, "seq"))
        token = _int(h, K_TOKEN, "token")
        if token >= limits.n_vocab:
            raise StageProtocolError(f"token {token} is not of the vocabulary of {limits.n_vocab}")
        more = limits.tokens(h.get(K_MORE, []), "a token's verified draft")
        lps = _logprobs(h, 1 + len(more), limits)
        return 0, _bare(Token(seq, token, _timing(h), more, lps))
    assert t == T_ERROR
    seq = h.get(K_SEQ)
    if seq is not None:
        seq = limits.seq(_int(h, K_SEQ, "seq"))
    message = h.get(K_ERROR, "")
    if not isinstance(message, str):
        raise StageProtocolError("a stage failure's message must be text")
    return 0, _bare(StageFailure(seq, message))


def _parse_open(h: dict[int, Any], limits: StageLimits) -> tuple[int, Build]:
    seq = limits.seq(_int(h, K_SEQ, "seq"))
    sampling = _sampling_from_cbor(h.get(K_SAMPLING))
    restore = h.get(K_RESTORE)
    if restore is not None:
        ok = isinstance(restore, list) and len(restore) == 2
        if not ok or not _uint(restore[0]) or restore[0] > MAX_ID or not _uint(restore[1]):
            raise StageProtocolError("an open's restore must be [entry, length]")
        if not 0 < restore[1] <= limits.slot_ctx:
            raise StageProtocolError(f"an open's restore length must be 1-{limits.slot_ctx}")
        restore = (restore[0], restore[1])
    # A replay's tokens so far: at most a slot's worth, u32 each.
    history = bool(h.get(K_HISTORY))
    size = _size(h, 4 * limits.slot_ctx if history else 0, "an open")
    if size % 4:
        raise StageProtocolError("an open's history must be whole u32 token ids")

    def build(payload: bytes) -> Message:
        ids = np.frombuffer(payload, dtype="<u4")
        if len(ids) and int(ids.max()) >= limits.n_vocab:
            raise StageProtocolError(
                f"an open's history holds token {int(ids.max())}, not of the vocabulary "
                f"of {limits.n_vocab}"
            )
        return Open(seq, sampling, tuple(int(x) for x in ids), restore)

    return size, build


def _parse_forward(h: dict[int, Any], limits: StageLimits) -> tuple[int, Build]:
    name = h.get(K_DTYPE)
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    width = h.get(K_WIDTH)
    raw_items = h.get(K_ITEMS)
    if dtype is None or not _uint(width):
        raise StageProtocolError("forward needs a dtype (f16/f32) and a positive width")
    if width != limits.width:
        raise StageProtocolError(
            f"hidden states {quoted(width)} wide reached a stage {limits.width} wide"
        )
    if not isinstance(raw_items, list) or not raw_items:
        raise StageProtocolError("forward needs a non-empty item list")
    items = tuple(_item_from_cbor(it, limits) for it in raw_items)
    rows = sum(i.n for i in items)
    if rows > limits.rows():
        raise StageProtocolError(f"forward of {rows} rows is over the {limits.rows()} slots hold")
    size = h.get(K_SIZE, 0)
    if size != rows * width * dtype.itemsize:
        raise StageProtocolError(
            f"forward payload of {quoted(size)} bytes does not hold {rows}x{width} {dtype}"
        )
    timing = _timing(h)
    layer = h.get(K_LAYER)
    if layer is not None:
        layer = _int(h, K_LAYER, "layer")

    def build(payload: bytes) -> Message:
        hidden = np.frombuffer(payload, dtype=dtype).reshape(rows, width)
        return Forward(items, hidden, timing, layer)

    return size, build
