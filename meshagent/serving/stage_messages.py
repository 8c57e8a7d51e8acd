"""Messages between the stages of a split model (sans-IO).

A message is `u32 header length (little-endian) | cbor header | payload`. Headers are cbor
maps with small integer keys and a version; activations travel as the payload in raw
little-endian f16 or f32, never as cbor arrays. `StageDecoder` is fed bytes and returns
messages, raising `StageProtocolError` on anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import cbor2
import numpy as np

from meshagent.errors import MeshError
from meshagent.serving.sampling import SamplingParams, TokenLogprob
from meshagent.wire.framing import Framing, LengthPrefixDecoder

VERSION = 1
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024
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
MAX_TOP_LOGPROBS = 20
MAX_STAGES = 64
T_OPEN, T_FORWARD, T_CLOSE, T_TOKEN, T_ERROR, T_KEEP, T_DROP = 1, 2, 3, 4, 5, 6, 7


class StageProtocolError(MeshError):
    """A malformed stage message: the stream it came on is closed."""


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


Message = Open | Forward | Close | Token | StageFailure | Keep | Drop


def _sampling_to_cbor(p: SamplingParams) -> dict[int, Any]:
    d = {0: p.temperature, 1: p.top_p, 2: p.seed, 3: p.presence_penalty, 4: p.frequency_penalty}
    if p.grammar is not None:  # both omitted when unset: the map is the bytes it always was
        d[5] = p.grammar
    if p.logprobs is not None:
        d[6] = p.logprobs
    if p.grammar_trigger is not None:
        d[7] = p.grammar_trigger
    if p.close_within is not None:
        d[8] = p.close_within
    return d


def _sampling_from_cbor(d: Any) -> SamplingParams:
    if not isinstance(d, dict):
        raise StageProtocolError("sampling parameters must be a map")
    try:
        return SamplingParams(
            temperature=float(d[0]),
            top_p=float(d[1]),
            seed=None if d[2] is None else int(d[2]),
            presence_penalty=float(d[3]),
            frequency_penalty=float(d[4]),
            grammar=_optional(d.get(5), str, "grammar"),
            logprobs=_top_count(d.get(6)),
            grammar_trigger=_optional(d.get(7), str, "grammar trigger"),
            close_within=_optional(d.get(8), int, "closing budget"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise StageProtocolError(f"bad sampling parameters: {e}") from e


def _optional(value: Any, kind: type, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
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


def _logprobs(h: dict[int, Any], tokens: int) -> tuple[TokenLogprob, ...]:
    raw = h.get(K_LOGPROBS)
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) != tokens:
        raise StageProtocolError("a token's logprobs must be one per token")
    out = []
    for entry in raw:
        ok = isinstance(entry, list) and len(entry) == 2 and _number(entry[0])
        top = entry[1] if ok else None
        ok = ok and isinstance(top, list) and len(top) <= MAX_TOP_LOGPROBS
        ok = ok and all(
            isinstance(p, list)
            and len(p) == 2
            and isinstance(p[0], int)
            and not isinstance(p[0], bool)
            and p[0] >= 0
            and _number(p[1])
            for p in top  # type: ignore[union-attr]
        )
        if not ok:
            raise StageProtocolError("a token's logprob must be [logprob, [[id, logprob]...]]")
        out.append(TokenLogprob(float(entry[0]), tuple((p[0], float(p[1])) for p in top)))
    return tuple(out)


def _item_to_cbor(i: ForwardItem) -> list[Any]:
    # Without a draft an item is the four fields it always was.
    fields: list[Any] = [i.seq, i.pos, i.n, i.sample]
    if i.follows:
        return [*fields, list(i.draft), True]
    return [*fields, list(i.draft)] if i.draft else fields


def _item_from_cbor(it: Any) -> ForwardItem:
    ok = isinstance(it, list) and len(it) in (4, 5, 6) and isinstance(it[3], bool)
    if not ok or not all(isinstance(x, int) and x >= 0 for x in it[:3]) or it[2] == 0:
        raise StageProtocolError(f"bad forward item {it!r}")
    draft: tuple[int, ...] = ()
    follows = len(it) == 6
    if follows and it[5] is not True:
        raise StageProtocolError(f"bad forward item {it!r}")
    if len(it) >= 5:
        d = it[4]
        # A window that follows another is all draft; any other keeps its first token.
        fits = len(d) == it[2] if follows else 0 < len(d) < it[2]
        ok = isinstance(d, list) and fits and it[3]
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in d):
            raise StageProtocolError(f"bad draft in forward item {it!r}")
        draft = tuple(d)
    return ForwardItem(it[0], it[1], it[2], it[3], draft, follows)


def _tokens(h: dict[int, Any]) -> tuple[int, ...]:
    more = h.get(K_MORE, [])
    ok = isinstance(more, list) and len(more) <= MAX_HEADER
    if not ok or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in more):
        raise StageProtocolError("a token's draft tokens must be non-negative integers")
    return tuple(more)


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
    else:  # pragma: no cover - the type union is closed
        raise TypeError(msg)
    return FRAMING.encode(cbor2.dumps(header)) + payload


@dataclass
class StageDecoder:
    """Feed bytes in, take whole messages out."""

    _frames: LengthPrefixDecoder = field(default_factory=lambda: LengthPrefixDecoder(FRAMING))
    _header: dict[int, Any] | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        self._frames.feed(data)
        out: list[Message] = []
        while True:
            if self._header is None:
                raw = self._frames.next_frame()
                if raw is None:
                    return out
                self._header = _header(raw)
            payload = self._frames.take(int(self._header.get(K_SIZE, 0)))
            if payload is None:
                return out
            header, self._header = self._header, None
            out.append(_message(header, payload))


def _header(raw: bytes) -> dict[int, Any]:
    try:
        h = cbor2.loads(raw)
    except Exception as e:  # cbor2 raises several unrelated types on garbage
        raise StageProtocolError(f"stage header is not cbor: {e}") from e
    if not isinstance(h, dict) or h.get(K_VERSION) != VERSION:
        raise StageProtocolError("stage header of an unknown version or shape")
    size = h.get(K_SIZE, 0)
    if not isinstance(size, int) or not 0 <= size <= MAX_PAYLOAD:
        raise StageProtocolError(f"bad stage payload size {size!r}")
    return h


def _int(h: dict[int, Any], key: int, what: str) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise StageProtocolError(f"stage message needs a non-negative integer {what}")
    return v


def _timing(h: dict[int, Any]) -> tuple[float, ...]:
    t = h.get(K_TIMING, [])
    if not isinstance(t, list) or len(t) > MAX_STAGES:
        raise StageProtocolError("stage timing must be a short list")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in t):
        raise StageProtocolError("stage timing must hold non-negative numbers")
    return tuple(float(x) for x in t)


def _message(h: dict[int, Any], payload: bytes) -> Message:
    t = h.get(K_TYPE)
    if t == T_OPEN:
        history: tuple[int, ...] = ()
        if h.get(K_HISTORY):
            if len(payload) % 4:
                raise StageProtocolError("an open's history must be whole u32 token ids")
            history = tuple(int(x) for x in np.frombuffer(payload, dtype="<u4"))
        elif payload:
            raise StageProtocolError("an open without history carries no payload")
        restore = h.get(K_RESTORE)
        if restore is not None:
            ok = isinstance(restore, list) and len(restore) == 2
            if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in restore):
                raise StageProtocolError("an open's restore must be [entry, length]")
            if restore[0] < 0 or restore[1] < 1:
                raise StageProtocolError("an open's restore must be [entry, length]")
            restore = (restore[0], restore[1])
        seq = _int(h, K_SEQ, "seq")
        return Open(seq, _sampling_from_cbor(h.get(K_SAMPLING)), history, restore)
    if t == T_KEEP:
        keep = Keep(_int(h, K_SEQ, "seq"), _int(h, K_ENTRY, "entry"), _int(h, K_LENGTH, "length"))
        if payload:
            raise StageProtocolError("a keep carries no payload")
        return keep
    if t == T_DROP:
        entries = h.get(K_ENTRIES)
        ok = isinstance(entries, list) and len(entries) <= MAX_HEADER
        if not ok or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entries
        ):
            raise StageProtocolError("a drop's entries must be non-negative integers")
        return Drop(tuple(entries))
    if t == T_CLOSE:
        return Close(_int(h, K_SEQ, "seq"))
    if t == T_TOKEN:
        more = _tokens(h)
        return Token(
            _int(h, K_SEQ, "seq"),
            _int(h, K_TOKEN, "token"),
            _timing(h),
            more,
            _logprobs(h, 1 + len(more)),
        )
    if t == T_ERROR:
        seq = h.get(K_SEQ)
        if seq is not None and (not isinstance(seq, int) or seq < 0):
            raise StageProtocolError("bad seq in stage error")
        return StageFailure(seq, str(h.get(K_ERROR, "")))
    if t == T_FORWARD:
        dtype = DTYPES.get(h.get(K_DTYPE))  # type: ignore[arg-type]
        width = h.get(K_WIDTH)
        raw_items = h.get(K_ITEMS)
        if dtype is None or not isinstance(width, int) or width <= 0:
            raise StageProtocolError("forward needs a dtype (f16/f32) and a positive width")
        if not isinstance(raw_items, list) or not raw_items:
            raise StageProtocolError("forward needs a non-empty item list")
        items = [_item_from_cbor(it) for it in raw_items]
        rows = sum(i.n for i in items)
        if len(payload) != rows * width * dtype.itemsize:
            raise StageProtocolError(
                f"forward payload of {len(payload)} bytes does not hold {rows}x{width} {dtype}"
            )
        hidden = np.frombuffer(payload, dtype=dtype).reshape(rows, width)
        layer = h.get(K_LAYER)
        if layer is not None:
            layer = _int(h, K_LAYER, "layer")
        return Forward(tuple(items), hidden, _timing(h), layer)
    raise StageProtocolError(f"unknown stage message type {t!r}")
