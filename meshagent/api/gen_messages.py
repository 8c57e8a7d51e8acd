"""The messages of `gen/1` streams (docs/protocol.md 11.1), without I/O.

Each is `u32 length | cbor map` (the framing of `api/1`), key 0 the version and key 1 the
kind: an `Ask` (asker to entry), then a `Head` or a `Fail`, then `Delta`s and a `Finished`
(`done`) or a `Fail` (entry to asker). Decoding validates every field once; anything else is a
`GenMessageError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cbor2

from meshagent.api.errors import ApiError, from_body
from meshagent.api.forwarding import FRAMING
from meshagent.api.tools import SYNTAXES
from meshagent.errors import MeshError
from meshagent.serving.directory import Headers
from meshagent.serving.generation import Delta, Finished, Logprob, Replay, Speculation

VERSION = 1


class GenMessageError(MeshError):
    """Bytes that are not a `gen/1` message of this version; the message says why."""


@dataclass(frozen=True)
class Ask:
    method: str
    path: str
    body: bytes
    history: tuple[int, ...] = ()  # a continuation: the tokens generated so far
    delivered: int = 0  # and the characters of their text the client has
    seed: int | None = None  # the seed the first entry sampled with


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


Message = Ask | Head | Fail | Delta | Finished


def encode(msg: Message) -> bytes:
    """`msg` framed for the stream."""
    return FRAMING.encode(cbor2.dumps({0: VERSION, **_fields(msg)}))


def _fields(msg: Message) -> dict[int, Any]:
    if isinstance(msg, Ask):
        fields: dict[int, Any] = {1: "ask", 2: msg.method, 3: msg.path, 4: msg.body}
        if msg.history or msg.delivered or msg.seed is not None:
            fields.update({5: list(msg.history), 6: msg.delivered, 7: msg.seed})
        return fields
    if isinstance(msg, Head):
        headers = [[k, v] for k, v in msg.headers]
        head = {1: "head", 2: headers, 3: msg.model, 4: msg.seed, 5: msg.prompt_tokens, 6: msg.echo}
        if msg.tools is not None:
            head[7] = msg.tools
        return head
    if isinstance(msg, Fail):
        e = msg.error
        return {1: "fail", 2: e.status, 3: e.body(), 4: e.retry_after, 5: msg.resumable}
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
    if msg.cached_tokens:
        done[8] = msg.cached_tokens
    return done


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
            Logprob(bytes(e[0]), float(e[1]), tuple((bytes(t), float(v)) for t, v in e[2]))
            for e in m.get(4, ())
        )
        return Delta(_str(m[2]), tuple(_int(t) for t in m[3]), lps)
    if kind == "done":
        replays = tuple(
            Replay(_str(r[0]), _int(r[1]), float(r[2]), float(r[3]), tuple(map(_str, r[4])))
            for r in m[6]
        )
        spec = None if m.get(7) is None else Speculation(*(_int(x) for x in m[7][:4]))
        stage_ms = tuple(float(x) for x in m[5])
        cached = _int(m.get(8, 0))
        return Finished(_str(m[2]), _int(m[3]), _int(m[4]), stage_ms, replays, spec, cached)
    if kind == "head":
        headers = [(bytes(k), bytes(v)) for k, v in m[2]]
        seed = None if m[4] is None else _int(m[4])
        tools = m.get(7)
        if tools is not None and tools not in SYNTAXES:
            raise GenMessageError(f"unknown tool-call syntax {tools!r}")
        return Head(headers, _str(m[3]), seed, _int(m[5]), _str(m[6]), tools)
    if kind == "fail":
        retry = None if m[4] is None else _int(m[4])
        return Fail(from_body(_int(m[2]), m[3], retry), bool(m[5]))
    if kind == "ask":
        seed = m.get(7)
        return Ask(
            _str(m[2]),
            _str(m[3]),
            bytes(m[4]),
            tuple(_int(t) for t in m.get(5, ())),
            _int(m.get(6, 0)),
            None if seed is None else _int(seed),
        )
    raise GenMessageError(f"unknown gen/1 message kind {kind!r}")


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v
