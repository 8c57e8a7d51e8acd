"""The messages of `gen/1` streams (docs/protocol.md 11.1), without I/O.

Each is `u32 length | cbor map` (`FRAMING`), key 0 the version and key 1 the kind: an `Ask`
(asker to entry); for a completion, then a `Head` or a `Fail`, then `Delta`s and a `Finished`
(`done`) or a `Fail`; for embeddings, a `Vector` per input and an `Embedded`, or a `Fail`
(entry to asker). A completion follows the asker onto a new connection: the asker opens a
stream there that begins with `Rejoin` (its ask's ticket), and the entry sends `Moved` last
on the old stream and the rest on the new one. Decoding validates every field once, each
integer against its range (`TOKEN_IDS`, `COUNTS`, `SEEDS`, `STATUSES`, `RETRY_AFTER`,
`TICKETS`), each vector's numbers finite; anything else is a `GenMessageError`. What only the
entry knows (its vocabulary, its slot's context) the entry checks when it takes the ask
(`api/entry.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from meshagent.api.errors import ApiError, from_body
from meshagent.api.tools import SYNTAXES
from meshagent.errors import MeshError
from meshagent.serving.directory import Headers
from meshagent.serving.generation import Delta, Finished, Logprob, Replay, Speculation
from meshagent.serving.sampling import SEEDS, seed_word
from meshagent.wire.framing import Framing
from meshagent.wire.quoted import quoted

VERSION = 1
MAX_MESSAGE = 16 * 1024 * 1024  # an ask's body is at most 8 MiB (`MAX_BODY`)

# The ranges of the integers a message may carry.
TOKEN_IDS = range(2**31)  # llama.cpp's token ids are int32 (the entry checks its vocabulary)
COUNTS = range(2**31)  # tokens and characters of one request
STATUSES = range(400, 600)  # a carried error's HTTP status
RETRY_AFTER = range(86_400 + 1)  # seconds: a day at most
MAX_SHARE = 64  # characters of the key that n completions of one request share
TICKETS = range(1, 2**63)  # the asker's name for a completion, to rejoin it on a new stream

# The receipt headers an entry may send (the asker hands them to its client): meshagent's own.
_RECEIPT_NAME = re.compile(rb"x-meshagent-[a-z0-9-]+")
_HEADER_VALUE = re.compile(rb"[\x20-\x7e]*")


class GenMessageError(MeshError):
    """Bytes that are not a `gen/1` message of this version; the message says why."""


FRAMING = Framing("gen/1 message", width=4, max_size=MAX_MESSAGE, error=GenMessageError)


@dataclass(frozen=True)
class Ask:
    method: str
    path: str
    body: bytes
    history: tuple[int, ...] = ()  # a continuation: the tokens generated so far
    delivered: int = 0  # and the characters of their text the client has
    seed: int | None = None  # the seed the first entry sampled with (or the asker chose)
    # The n completions of one request, each asked on a stream of its own, share this key:
    # the entry prefills their prompt once (`GenerationRequest.share`).
    share: str | None = None
    # Random, the asker's: a stream from the same peer that begins with `Rejoin(ticket)`
    # takes the completion over (its connection replaced this one's). None: it stays put.
    ticket: int | None = None


@dataclass(frozen=True)
class Rejoin:
    """The first message of a `gen/1` stream that takes over the completion the same asker
    asked with `ticket`, on another connection."""

    ticket: int


@dataclass(frozen=True)
class Moved:
    """The last message on a completion's old stream: the rest comes on the rejoined one."""


@dataclass(frozen=True)
class Head:
    headers: Headers  # the entry's receipt
    model: str
    seed: int | None
    prompt_tokens: int
    echo: str = ""
    tools: str | None = None  # the syntax the model writes tool calls in, if it may call any


@dataclass(frozen=True)
class Fail:
    error: ApiError
    resumable: bool  # another entry may take the request over


@dataclass(frozen=True)
class Vector:
    """The embedding of one input, in the order of the request's inputs."""

    values: tuple[float, ...]


@dataclass(frozen=True)
class Embedded:
    """The end of an embeddings answer: the model that embedded and the tokens it read."""

    model: str
    tokens: int


Message = Ask | Head | Fail | Delta | Finished | Vector | Embedded | Rejoin | Moved


def encode(msg: Message) -> bytes:
    """`msg` framed for the stream."""
    return FRAMING.encode(cbor2.dumps({0: VERSION, **_fields(msg)}))


def _fields(msg: Message) -> dict[int, Any]:
    if isinstance(msg, Ask):
        fields: dict[int, Any] = {1: "ask", 2: msg.method, 3: msg.path, 4: msg.body}
        if msg.history or msg.delivered or msg.seed is not None:
            fields.update({5: list(msg.history), 6: msg.delivered, 7: _seed_bits(msg.seed)})
        if msg.share is not None:
            fields[8] = msg.share
        if msg.ticket is not None:
            fields[9] = msg.ticket
        return fields
    if isinstance(msg, Rejoin):
        return {1: "rejoin", 2: msg.ticket}
    if isinstance(msg, Moved):
        return {1: "moved"}
    if isinstance(msg, Head):
        headers = [[k, v] for k, v in msg.headers]
        seed = _seed_bits(msg.seed)
        head = {1: "head", 2: headers, 3: msg.model, 4: seed, 5: msg.prompt_tokens, 6: msg.echo}
        if msg.tools is not None:
            head[7] = msg.tools
        return head
    if isinstance(msg, Fail):
        e = msg.error
        return {1: "fail", 2: e.status, 3: e.body(), 4: e.retry_after, 5: msg.resumable}
    if isinstance(msg, Vector):
        return {1: "vector", 2: np.asarray(msg.values, dtype="<f8").tobytes()}
    if isinstance(msg, Embedded):
        return {1: "embedded", 2: msg.model, 3: msg.tokens}
    if isinstance(msg, Delta):
        fields = {1: "delta", 2: msg.text, 3: list(msg.tokens)}
        if msg.logprobs:
            fields[4] = [[lp.token, lp.logprob, [list(t) for t in lp.top]] for lp in msg.logprobs]
        return fields
    replays = [[r.reason, r.tokens, r.ms, r.wait_ms, list(r.lost)] for r in msg.replays]
    done = {
        1: "done",
        2: msg.reason,
        3: msg.prompt_tokens,
        4: msg.completion_tokens,
        5: list(msg.stage_ms),
        6: replays,
    }
    if (s := msg.speculation) is not None:
        done[7] = [s.windows, s.drafted, s.accepted, s.peak_in_flight]
        if s.draft_model is not None:
            done[7] += [s.model_windows, s.model_drafted, s.model_accepted, s.draft_model]
    if msg.cached_tokens:
        done[8] = msg.cached_tokens
    if msg.stop is not None:
        done[9] = msg.stop
    return done


MAX_STOP = 4096  # characters of the stop string a done message names
MAX_DRAFT_NAME = 256  # characters of the draft model's name a done message gives


def _seed_bits(seed: int | None) -> int | None:
    """A seed as it travels: the 64 bits the sampler draws with (`serving/sampling.py`), so
    an HTTP client's seed of any size or sign samples alike on every entry."""
    return None if seed is None else seed_word(seed)


def decode(body: bytes) -> Message:
    """One message from its frame's body; `GenMessageError` if it is not one of this version."""
    try:
        m = cbor2.loads(body)
        if not isinstance(m, dict) or m.get(0) != VERSION:
            raise GenMessageError("a gen/1 message of an unknown version or shape")
        return _message(m)
    except GenMessageError:
        raise
    except Exception as e:  # cbor2 and the field checks raise several unrelated types
        raise GenMessageError(f"malformed gen/1 message: {e}") from e


def _message(m: dict[int, Any]) -> Message:
    kind = m[1]
    if kind == "delta":
        lps = tuple(
            Logprob(_bytes(e[0]), _logprob(e[1]), tuple((_bytes(t), _logprob(v)) for t, v in e[2]))
            for e in m.get(4, ())
        )
        return Delta(_str(m[2]), _tokens(m[3]), lps)
    if kind == "done":
        replays = tuple(
            Replay(
                _str(r[0]),
                _int(r[1], COUNTS, "replayed tokens"),
                _ms(r[2]),
                _ms(r[3]),
                tuple(map(_str, r[4])),
            )
            for r in m[6]
        )
        spec = None
        if m.get(7) is not None:
            counts = [_int(x, COUNTS, "speculation count") for x in m[7][:4]]
            spec = Speculation(*counts)
            if len(m[7]) >= 8:
                model = [_int(x, COUNTS, "speculation count") for x in m[7][4:7]]
                name = _str(m[7][7])
                if len(name) > MAX_DRAFT_NAME:
                    raise GenMessageError("a draft model's name longer than any model's")
                spec = Speculation(*counts, *model, name)
        stage_ms = tuple(_ms(x) for x in m[5])
        cached = _int(m.get(8, 0), COUNTS, "cached tokens")
        prompt = _int(m[3], COUNTS, "prompt tokens")
        completion = _int(m[4], COUNTS, "completion tokens")
        stop = None if m.get(9) is None else _str(m[9])
        if stop is not None and len(stop) > MAX_STOP:
            raise GenMessageError("a stop string longer than any request may give")
        return Finished(_str(m[2]), prompt, completion, stage_ms, replays, spec, cached, stop)
    if kind == "head":
        headers = [_receipt_header(_bytes(k), _bytes(v)) for k, v in m[2]]
        seed = None if m[4] is None else _int(m[4], SEEDS, "seed")
        tools = m.get(7)
        if tools is not None and tools not in SYNTAXES:
            raise GenMessageError(f"unknown tool-call syntax {quoted(tools)}")
        prompt = _int(m[5], COUNTS, "prompt tokens")
        return Head(headers, _str(m[3]), seed, prompt, _str(m[6]), tools)
    if kind == "fail":
        retry = None if m[4] is None else _int(m[4], RETRY_AFTER, "Retry-After")
        return Fail(from_body(_int(m[2], STATUSES, "error status"), m[3], retry), bool(m[5]))
    if kind == "ask":
        seed, share, ticket = m.get(7), m.get(8), m.get(9)
        if share is not None and len(_str(share)) > MAX_SHARE:
            raise GenMessageError(f"a share key of over {MAX_SHARE} characters")
        return Ask(
            _str(m[2]),
            _str(m[3]),
            _bytes(m[4]),
            _tokens(m.get(5, ())),
            _int(m.get(6, 0), COUNTS, "delivered characters"),
            None if seed is None else _int(seed, SEEDS, "seed"),
            share,
            None if ticket is None else _int(ticket, TICKETS, "ticket"),
        )
    if kind == "rejoin":
        return Rejoin(_int(m[2], TICKETS, "ticket"))
    if kind == "moved":
        return Moved()
    if kind == "vector":
        return Vector(_vector(_bytes(m[2])))
    if kind == "embedded":
        return Embedded(_str(m[2]), _int(m[3], COUNTS, "embedded tokens"))
    raise GenMessageError(f"unknown gen/1 message kind {quoted(kind)}")


def _tokens(v: Any) -> tuple[int, ...]:
    return tuple(_int(t, TOKEN_IDS, "token id") for t in v)


def _int(v: Any, allowed: range, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    if v not in allowed:
        raise GenMessageError(f"{what} {quoted(v)} is outside {allowed.start}-{allowed.stop - 1}")
    return v


def _float(v: Any, what: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an integer past 1.8e308
        raise GenMessageError(f"{what} of {quoted(v)}, which no float holds") from None


def _ms(v: Any) -> float:
    ms = _float(v, "a duration")
    if not (math.isfinite(ms) and ms >= 0):
        raise GenMessageError(f"a duration of {ms} ms")
    return ms


def _logprob(v: Any) -> float:
    lp = _float(v, "a log-probability")
    if math.isnan(lp):
        raise GenMessageError("a log-probability that is not a number")
    return lp


def _vector(raw: bytes) -> tuple[float, ...]:
    """An embedding's numbers: little-endian float64, at least one, every one finite."""
    if not raw or len(raw) % 8:
        raise GenMessageError(f"a vector of {len(raw)} bytes is not a whole number of float64s")
    values = np.frombuffer(raw, dtype="<f8")
    if not np.isfinite(values).all():
        raise GenMessageError("a vector holds a number that is not finite")
    return tuple(values.tolist())


def _bytes(v: Any) -> bytes:
    # (Never `bytes(v)`: an integer there would allocate that many bytes.)
    if not isinstance(v, bytes):
        raise TypeError(f"expected bytes, got {type(v).__name__}")
    return v


def _receipt_header(name: bytes, value: bytes) -> tuple[bytes, bytes]:
    if not _RECEIPT_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
        raise GenMessageError(f"a receipt header that is not meshagent's: {name[:40]!r}")
    return name, value


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v
