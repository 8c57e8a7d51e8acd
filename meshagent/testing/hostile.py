"""A hostile member of a running mesh: the adversary of docs/security.md, for tests and benchmarks.

`HostileMember` joins each agent it is given with the mesh secret (`testing/member.py`) and
plays what `cases(seed, ...)` draws: on every overlay label an agent routes, a message built
with the project's own encoders and then bent (integers out of range, wrong types, frames cut
short or declared huge, garbage, forged gossip items, requests for another agent's control
plane, streams opened and left), plus connections under fresh identities, under another
mesh's secret and without a handshake. Each case goes on a stream of its own (some on a
connection of their own), its answer is read for a short while and classified (`ANSWERED`,
`REFUSED`, `RESET`, `CLOSED`, `SILENT`, `LOST`, `UNREACHABLE`); a `Tally` counts what was sent
by label and what came of it, and which answers a well-behaved agent would have refused
(`breaches`). The gossip exchanges an agent starts with the member are answered with forged
items too. The same seed draws the same cases; nothing here leaves loopback.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import cbor2
import numpy as np
import trio
from nacl.signing import SigningKey

from meshagent.api import gen_messages as gm
from meshagent.api.errors import ApiError
from meshagent.discovery import hearing, probe
from meshagent.errors import MeshError
from meshagent.gossip import messages as gossip
from meshagent.gossip.config import GossipConfig
from meshagent.gossip.service import LABEL as GOSSIP_LABEL
from meshagent.gossip.signed import Heartbeat, Obituary
from meshagent.identity.keys import NodeIdentity
from meshagent.identity.mesh import MeshSecret, mesh_fingerprint
from meshagent.models import header_share, transfer
from meshagent.net.address import Address, is_loopback
from meshagent.net.backoff import Backoff
from meshagent.net.config import OverlayConfig
from meshagent.net.errors import ConnectionUnavailable, StreamResetError
from meshagent.net.stream import MeshStream
from meshagent.serving import stage_messages as sm
from meshagent.serving.directory import GENERATE_LABEL
from meshagent.serving.generation import Delta, Finished
from meshagent.serving.pipeline import REPLY_LABEL, STAGE_LABEL
from meshagent.serving.sampling import SamplingParams
from meshagent.testing.member import AgentAddress, Member
from meshagent.wire.control import MAX_LABEL_LEN
from meshagent.wire.framing import Framing, LengthPrefixDecoder

# What came of a case.
ANSWERED = "answered"  # the agent answered as it answers a member's request
REFUSED = "refused"  # it answered with its protocol's refusal, or refused the handshake
RESET = "reset"  # it reset the stream (with the reason it gave)
CLOSED = "closed"  # it ended the stream, or the bare connection, without a word
SILENT = "silent"  # nothing within the deadline: the member dropped the stream
LOST = "lost"  # the connection ended under the case (the agent closed it, or died)
UNREACHABLE = "unreachable"  # no connection to the agent could be made
OUTCOMES = (ANSWERED, REFUSED, RESET, CLOSED, SILENT, LOST, UNREACHABLE)

CONNECT = "(connect)"  # the label counted for connection cases
OTHER = "(other)"  # ...and for streams of labels no agent routes
LABELS = (
    GOSSIP_LABEL,
    transfer.LABEL,
    header_share.LABEL,
    probe.LABEL,
    hearing.LABEL,
    GENERATE_LABEL,
    STAGE_LABEL,
    REPLY_LABEL,
)

# The integers a peer is never trusted with (plus the receiver's own bounds: `Draw.bad_int`).
BAD_INTS = (-1, -(2**63), 2**31, 2**32, 2**63, 2**64 - 1, 2**64, 2**70)
_HUGE_PAYLOAD = 256 << 20  # a stage payload as large as any decoder ever allowed
_KEEP = 1 << 20  # bytes of an answer kept for reading it; the rest is counted only
_FAST = OverlayConfig(dial_backoff=Backoff(attempts=1), handshake_timeout=5.0)


@dataclass(frozen=True)
class Knowledge:
    """What the member knows of the agents it attacks: the model's shape (the defaults are
    the embedded SmolLM2-135M's) and, filled in by `HostileMember`, the mesh and its peers."""

    model: str = "SmolLM2-135M-Instruct.Q4_1"
    vocab: int = 49152
    width: int = 576  # hidden size: a stage's rows
    layers: int = 30
    slots: int = 4
    ctx: int = 512  # tokens per slot
    mesh: str = ""  # the mesh's fingerprint (gossip items are signed for it)
    peers: tuple[str, ...] = ()  # every agent's peer id


@dataclass(frozen=True)
class Case:
    """One attempt. A stream case opens `label` (on a connection of its own under a fresh
    identity if `fresh`), writes `send`, half-closes unless `eof` is False (the stream is
    left open), and reads the answer for `wait` seconds at most; `then` (gossip) gives what
    to write once the agent's first message is in. Connection cases (`kind`): `members`
    fresh identities connect at once, a `stranger` handshakes under another mesh's secret,
    `raw` bytes go to the overlay port without a handshake."""

    label: str
    name: str  # family.variant: what it tries
    send: tuple[bytes, ...] = ()
    eof: bool = True
    wait: float | None = None  # None: the member's deadline
    then: Callable[[bytes], bytes | None] | None = None
    fresh: bool = False
    # A well-behaved agent refuses it: an answer is a breach, and so is silence once the
    # case said all it had to (`eof`).
    refuse: bool = True
    kind: str = "stream"  # or "members", "stranger", "raw"
    members: int = 0

    @property
    def counted_as(self) -> str:
        """The label it is counted under."""
        if self.kind != "stream":
            return CONNECT
        base = self.label.split(":", 1)[0]
        return base if base in LABELS else OTHER

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.send)


@dataclass(frozen=True)
class Result:
    target: str
    label: str  # as counted
    name: str
    outcome: str
    reason: str
    sent: int  # bytes
    seconds: float
    breach: bool


@dataclass
class Tally:
    """What a hostile run sent and what came of it."""

    sent: Counter[str] = field(default_factory=Counter)  # cases by label
    bytes_sent: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (label, outcome)
    reasons: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    by_case: Counter[tuple[str, str]] = field(default_factory=Counter)  # (name, outcome)
    breaches: Counter[str] = field(default_factory=Counter)  # case names
    breaches_by_label: Counter[str] = field(default_factory=Counter)
    by_target: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, outcome)
    started: float = 0.0
    last_sent: float = 0.0  # when the last case began
    ended: float = 0.0  # when the last case was over
    # The longest the member's own event loop went without running (its stalls make an
    # agent drop its connection as silent: a figure to check before blaming the agent).
    max_lag: float = 0.0
    # Per agent, the first case whose connection ended under it, with the cases then in
    # flight to that agent: where to look first when an agent died.
    first_lost: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, r: Result) -> None:
        self.sent[r.label] += 1
        self.bytes_sent[r.label] += r.sent
        self.outcomes[r.label, r.outcome] += 1
        self.reasons[r.label, r.outcome, r.reason] += 1
        self.by_case[r.name, r.outcome] += 1
        self.by_target[r.target, r.outcome] += 1
        if r.breach:
            self.breaches[r.name] += 1
            self.breaches_by_label[r.label] += 1

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    @property
    def seconds(self) -> float:
        """How long cases were being started."""
        return max(self.last_sent - self.started, 1e-9)

    def count(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcomes.items() if o == outcome)

    def to_json(self) -> dict[str, Any]:
        labels = sorted(self.sent)
        return {
            "cases": self.total,
            "seconds": round(self.seconds, 3),
            "seconds_to_last_answer": round(self.ended - self.started, 3),
            "per_second": round(self.total / self.seconds, 2),
            "sent": {lb: self.sent[lb] for lb in labels},
            "bytes_sent": {lb: self.bytes_sent[lb] for lb in labels},
            "outcomes": {
                lb: {o: self.outcomes[lb, o] for o in OUTCOMES if self.outcomes[lb, o]}
                for lb in labels
            },
            "reasons": [
                {"label": lb, "outcome": o, "reason": why, "count": n}
                for (lb, o, why), n in self.reasons.most_common()
            ],
            "cases_by_name": {
                name: {o: n for (nm, o), n in sorted(self.by_case.items()) if nm == name}
                for name in sorted({nm for nm, _ in self.by_case})
            },
            "breaches": dict(self.breaches.most_common()),
            "breaches_by_label": {lb: self.breaches_by_label[lb] for lb in labels},
            "member_max_lag_s": round(self.max_lag, 3),
            "first_lost": self.first_lost,
            "by_target": {
                peer: {o: n for (p, o), n in self.by_target.items() if p == peer}
                for peer in sorted({p for p, _ in self.by_target})
            },
        }


# ----- drawing cases -------------------------------------------------------------------------


@dataclass
class Draw:
    """What a case builder draws from: the seeded generator, what the member knows, the
    agent the case goes to and the others."""

    rng: random.Random
    k: Knowledge
    target: str
    others: tuple[str, ...]
    label: str
    name: str

    def case(self, *send: bytes, **kw: Any) -> Case:
        kw.setdefault("label", self.label)
        return Case(name=self.name, send=send, **kw)

    def pick(self, *options: Any) -> Any:
        return options[self.rng.randrange(len(options))]

    def bad_int(self, *bounds: int) -> int:
        """An integer no peer may send where `bounds` (the receiver's own limits) bound it."""
        return self.pick(*BAD_INTS, *bounds)

    def blob(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))

    def identity(self) -> NodeIdentity:
        return NodeIdentity(SigningKey(self.rng.randbytes(32)))

    def other(self) -> str:
        """Another agent (the target itself when it is alone)."""
        return self.pick(*self.others) if self.others else self.target

    def hold(self) -> float:
        return round(self.rng.uniform(1.0, 3.0), 2)


Builder = Callable[[Draw], Case]
_BUILDERS: list[tuple[str, str, Builder]] = []


def _case(label: str, name: str) -> Callable[[Builder], Builder]:
    def register(build: Builder) -> Builder:
        _BUILDERS.append((label, name, build))
        return build

    return register


def case_names() -> list[str]:
    """Every case the generator draws from, and the member's answers to an agent's streams."""
    answers = [f"gossip.answer.{k}" for k in _ANSWER_KINDS]
    return [name for _, name, _ in _BUILDERS] + [*answers, "hear.answer"]


def cases(
    seed: int, knowledge: Knowledge, targets: Sequence[str], *, skip: Sequence[str] = ()
) -> Iterator[tuple[str, Case]]:
    """An endless, reproducible run of (target peer id, case): a label drawn evenly (the
    connection cases and unrouted labels a third as often), then one of its cases; names
    starting with any of `skip` are left out."""
    rng = random.Random(seed)
    by_label: dict[str, list[Builder]] = {}
    for label, name, build in _BUILDERS:
        if not _skipped(name, skip):
            by_label.setdefault(label, []).append(build)
    labels = sorted(by_label)
    weights = [0.3 if label in (CONNECT, OTHER) else 1.0 for label in labels]
    names = {build: name for _, name, build in _BUILDERS}
    while True:
        label = rng.choices(labels, weights)[0]
        build = rng.choice(by_label[label])
        target = rng.choice(list(targets))
        others = tuple(t for t in targets if t != target)
        draw = Draw(rng, knowledge, target, others, label, names[build])
        yield target, build(draw)


# -- what every framed label gets: garbage, frames cut short or declared huge, streams left open


def _framed(family: str, label: str, framing: Framing, valid: Callable[[Draw], bytes]) -> None:

    @_case(label, f"{family}.garbage")
    def _(d: Draw) -> Case:
        return d.case(d.blob(1, 4096))

    @_case(label, f"{family}.truncated")
    def _(d: Draw) -> Case:
        msg = valid(d)
        return d.case(msg[: d.rng.randrange(1, len(msg))])

    @_case(label, f"{family}.declared_huge")
    def _(d: Draw) -> Case:
        largest = (1 << 8 * framing.width) - 1
        size = d.pick(min(framing.max_size + 1, largest), largest)
        return d.case(size.to_bytes(framing.width, framing.byteorder) + d.blob(0, 1024))

    @_case(label, f"{family}.declared_then_left")
    def _(d: Draw) -> Case:
        # A length the receiver accepts, and less than it says, on a stream left open.
        size = min(framing.max_size, 1 << 20)
        body = size.to_bytes(framing.width, framing.byteorder) + d.blob(0, size // 4)
        return d.case(body, eof=False, wait=d.hold())

    @_case(label, f"{family}.empty")
    def _(d: Draw) -> Case:
        return d.case()

    @_case(label, f"{family}.left_open")
    def _(d: Draw) -> Case:
        return d.case(eof=False, wait=d.hold())


def _cbor_frame(framing: Framing, fields: dict[Any, Any]) -> bytes:
    return framing.encode(cbor2.dumps(fields))


# -- gen/1: a carried request to the entry of a model


def _completion(d: Draw, **extra: Any) -> bytes:
    body = {"model": d.k.model, "prompt": "Count: 1, 2,", "max_tokens": 2, "temperature": 0}
    return json.dumps({**body, **extra}).encode()


def _ask(d: Draw, **fields: Any) -> bytes:
    ask = gm.Ask("POST", "/v1/completions", _completion(d))
    return gm.encode(replace(ask, **fields))


def _ask_raw(d: Draw, **fields: Any) -> bytes:
    """An Ask whose fields the encoder would not write (any value, any type)."""
    m: dict[int, Any] = {0: gm.VERSION, 1: "ask", 2: "POST", 3: "/v1/completions"}
    m[4] = _completion(d)
    m.update({int(k.removeprefix("f")): v for k, v in fields.items()})
    return _cbor_frame(gm.FRAMING, m)


_framed("gen", GENERATE_LABEL, gm.FRAMING, lambda d: _ask(d))


@_case(GENERATE_LABEL, "gen.history_out_of_vocab")
def _(d: Draw) -> Case:
    bad = d.bad_int(d.k.vocab, d.k.vocab + 1)
    at = d.rng.randint(0, 3)
    history = (*(d.rng.randrange(d.k.vocab) for _ in range(at)), bad)
    return d.case(_ask(d, history=history))


@_case(GENERATE_LABEL, "gen.history_too_long")
def _(d: Draw) -> Case:
    n = d.pick(d.k.ctx, d.k.ctx * d.k.slots + 1, 100_000)
    return d.case(_ask(d, history=tuple(d.rng.randrange(d.k.vocab) for _ in range(n))))


@_case(GENERATE_LABEL, "gen.delivered_or_seed")
def _(d: Draw) -> Case:
    if d.rng.random() < 0.5:
        return d.case(_ask(d, history=(1, 2), delivered=d.bad_int(10**9)))
    # A seed of any size or sign is a usable seed (its low 64 bits sample); what a peer may
    # not send is one the wire's range does not hold, or not an integer.
    return d.case(_ask_raw(d, f5=[1, 2], f6=0, f7=d.pick(2**64, 2**70, -1, 1.5, "7")))


@_case(GENERATE_LABEL, "gen.wrong_types")
def _(d: Draw) -> Case:
    field_, value = d.pick(
        ("f5", "1,2,3"),
        ("f5", [1.5, 2]),
        ("f5", [True]),
        ("f5", {"a": 1}),
        ("f6", "0"),
        ("f7", 1.5),
        ("f4", "a body that is text, not bytes"),
        ("f3", 7),
        ("f2", None),
    )
    return d.case(_ask_raw(d, **{field_: value}))


@_case(GENERATE_LABEL, "gen.control_path")
def _(d: Draw) -> Case:
    method, path = d.pick(
        ("GET", "/control/status"),
        ("GET", "/metrics"),
        ("POST", "/control/probe"),
        ("GET", "/control/peers"),
        ("GET", "/control/events"),
        ("GET", "/console"),
        ("GET", "/nope"),
        ("BREW", "/v1/completions"),
        ("POST", "/" + "x" * 10_000),
    )
    body = json.dumps({"peer": d.other()[:12], "bytes": 65536}).encode()
    return d.case(gm.encode(gm.Ask(method, path, body)))


@_case(GENERATE_LABEL, "gen.bad_body")
def _(d: Draw) -> Case:
    return d.case(gm.encode(gm.Ask("POST", "/v1/completions", _bad_completion(d))))


@_case(GENERATE_LABEL, "gen.not_an_ask_first")
def _(d: Draw) -> Case:
    msg = d.pick(
        Delta("injected", (1, 2)),
        Finished("stop", 1, 1),
        gm.Fail(ApiError(500, "hostile"), True),
        gm.Head([], d.k.model, None, 1),
    )
    return d.case(gm.encode(msg))


@_case(GENERATE_LABEL, "gen.other_version")
def _(d: Draw) -> Case:
    return d.case(_ask_raw(d, f0=d.pick(0, 2, 2**64, "1")))


@_case(GENERATE_LABEL, "gen.ask_then_leave")
def _(d: Draw) -> Case:
    # A well-formed request, the stream dropped once it has begun: members may ask.
    return d.case(_ask(d), eof=False, wait=0.3, refuse=False)


def _bad_completion(d: Draw) -> bytes:
    """A completion body with one field out of range or of the wrong type."""
    key, value = d.pick(
        ("max_tokens", d.bad_int()),
        ("n", d.pick(2**31, 10_000, -1)),
        ("seed", d.bad_int()),
        ("logit_bias", {str(d.bad_int(d.k.vocab)): 100}),
        ("logit_bias", {"not a token": 1}),
        ("logprobs", d.pick(2**31, -1, 21)),
        ("temperature", d.pick(-1, 1e308, "hot")),
        ("top_p", d.pick(-1, 2, None)),
        ("stop", ["x" * 100_000]),
        ("stop", [d.rng.randbytes(8).hex()] * 1000),
        ("prompt", [d.bad_int(d.k.vocab)]),
        ("prompt", [[d.rng.randrange(d.k.vocab)] * 3] * 64),
        ("prompt", 42),
        ("model", None),
        ("presence_penalty", d.pick(1e308, -1e308)),
    )
    return _completion(d, **{key: value})


# -- stage/1 and stage-reply/1: the messages between the stages of a split


def _stage_raw(header: dict[int, Any], payload: bytes = b"") -> bytes:
    return sm.FRAMING.encode(cbor2.dumps({sm.K_VERSION: sm.VERSION, **header})) + payload


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0)


def _seq(d: Draw) -> int:
    """A sequence id: out of range mostly, sometimes one of the slots (someone's request)."""
    if d.rng.random() < 0.25:
        return d.rng.randrange(d.k.slots)
    return d.bad_int(d.k.slots, d.k.slots + 1)


def _forward(d: Draw, items: Any, width: int, dtype: str = "f16") -> bytes:
    """A forward of `items` (as they are, valid or not) with rows of random values."""
    rows = 0
    if isinstance(items, list):
        sized = [it for it in items if isinstance(it, list) and len(it) > 2]
        rows = sum(it[2] for it in sized if isinstance(it[2], int) and 0 < it[2] < 4096)
    hidden = np.frombuffer(d.rng.randbytes(rows * width * 2), dtype="<f2").astype(sm.DTYPES[dtype])
    if dtype == "f32" and d.rng.random() < 0.5:
        hidden = np.full_like(hidden, d.pick(np.nan, np.inf, -np.inf, 1e38))
    header = {
        sm.K_TYPE: sm.T_FORWARD,
        sm.K_ITEMS: items,
        sm.K_DTYPE: dtype,
        sm.K_WIDTH: width,
        sm.K_SIZE: hidden.nbytes,
        sm.K_TIMING: [],
    }
    return _stage_raw(header, hidden.tobytes())


_framed("stage", STAGE_LABEL, sm.FRAMING, lambda d: sm.encode(sm.Open(0, _greedy())))


@_case(STAGE_LABEL, "stage.open_seq")
def _(d: Draw) -> Case:
    return d.case(sm.encode(sm.Open(_seq(d), _greedy())))


@_case(STAGE_LABEL, "stage.close_seq")
def _(d: Draw) -> Case:
    return d.case(sm.encode(sm.Close(_seq(d))))


@_case(STAGE_LABEL, "stage.open_then_close")
def _(d: Draw) -> Case:
    seq = _seq(d)
    opened = sm.encode(sm.Open(seq, _greedy()))
    return d.case(opened + sm.encode(sm.Close(seq)))


@_case(STAGE_LABEL, "stage.keep")
def _(d: Draw) -> Case:
    seq, entry, length = d.pick(
        (_seq(d), 0, 1),
        (0, d.bad_int(), 1),
        (0, 0, d.bad_int(d.k.ctx, d.k.ctx + 1)),
    )
    return d.case(sm.encode(sm.Keep(seq, entry, length)))


@_case(STAGE_LABEL, "stage.drop_many")
def _(d: Draw) -> Case:
    n = d.pick(1000, 5000, 20_000)
    return d.case(sm.encode(sm.Drop(tuple(d.rng.randrange(2**63) for _ in range(n)))))


@_case(STAGE_LABEL, "stage.open_history")
def _(d: Draw) -> Case:
    ids = [d.rng.randrange(d.k.vocab) for _ in range(d.rng.randint(0, 4))]
    ids.append(d.pick(d.k.vocab, d.k.vocab + 1, 2**31, 2**32 - 1))
    payload = np.asarray(ids, dtype="<u4").tobytes()
    if d.rng.random() < 0.3:
        payload = payload[:-1]  # not whole u32 ids
    header = {
        sm.K_TYPE: sm.T_OPEN,
        sm.K_SEQ: d.rng.randrange(d.k.slots),
        sm.K_SAMPLING: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0},
        sm.K_HISTORY: True,
        sm.K_SIZE: len(payload),
    }
    return d.case(_stage_raw(header, payload))


@_case(STAGE_LABEL, "stage.open_restore")
def _(d: Draw) -> Case:
    restore = d.pick([d.bad_int(), 1], [0, d.bad_int(d.k.ctx + 1)], [0, 0], "0,1", [0])
    header = {
        sm.K_TYPE: sm.T_OPEN,
        sm.K_SEQ: d.rng.randrange(d.k.slots),
        sm.K_SAMPLING: {0: 0.0, 1: 1.0, 2: None, 3: 0.0, 4: 0.0},
        sm.K_RESTORE: restore,
    }
    return d.case(_stage_raw(header))


@_case(STAGE_LABEL, "stage.open_sampling")
def _(d: Draw) -> Case:
    sampling: dict[int, Any] = {0: 0.7, 1: 0.9, 2: 1, 3: 0.0, 4: 0.0}
    key, value = d.pick(
        (0, math.nan),
        (0, -1.0),
        (0, math.inf),
        (1, -3.0),
        (1, 2.0),
        (2, d.bad_int()),
        (3, math.nan),
        (4, 1e308),
        (5, "root ::= (((("),
        (5, "root ::= " + " | ".join(f'"{i}"' for i in range(8000))),
        (6, 21),
        (6, -1),
        (7, "(((["),
        (8, d.bad_int()),
        (0, "warm"),
    )
    sampling[key] = value
    header = {sm.K_TYPE: sm.T_OPEN, sm.K_SEQ: d.rng.randrange(d.k.slots), sm.K_SAMPLING: sampling}
    return d.case(_stage_raw(header))


@_case(STAGE_LABEL, "stage.forward")
def _(d: Draw) -> Case:
    n = d.rng.randint(1, 8)
    seq, pos = d.rng.randrange(d.k.slots), d.rng.randrange(d.k.ctx - n)
    width, dtype = d.k.width, d.pick("f16", "f32")
    bent = d.pick("seq", "pos", "end", "width", "draft", "layer", "none")
    if bent == "seq":
        seq = d.bad_int(d.k.slots)
    elif bent == "pos":
        pos = d.bad_int(d.k.ctx)
    elif bent == "end":
        pos = d.k.ctx - 1  # the rows run past the slot's context
    elif bent == "width":
        width = d.pick(1, d.k.width - 1, d.k.width * 4)
    item: list[Any] = [seq, pos, n, True]
    if bent == "draft" and n > 1:
        item.append([d.bad_int(d.k.vocab)] * (n - 1))
    msg = _forward(d, [item], width, dtype)
    if bent == "layer":
        header = cbor2.loads(msg[4 : 4 + int.from_bytes(msg[:4], "little")])
        header[sm.K_LAYER] = d.bad_int(d.k.layers)
        msg = _stage_raw(header, msg[4 + int.from_bytes(msg[:4], "little") :])
    opened = sm.encode(sm.Open(seq, _greedy())) if 0 <= seq < 2**32 else b""
    return d.case(opened + msg)


@_case(STAGE_LABEL, "stage.forward_shape")
def _(d: Draw) -> Case:
    items = d.pick(
        [[0, 0, 0, True]],
        [[0, 0, 2**31, True]],
        [[0, 0, 1, "yes"]],
        [[0, 0, 1, True, [1, 2, 3]]],
        [[0, 0, 1, True, [], False]],
        [],
        {"0": 1},
    )
    return d.case(_forward(d, items, d.k.width))


@_case(STAGE_LABEL, "stage.huge_payload")
def _(d: Draw) -> Case:
    # A payload declared as large as the decoder allows, and less of it sent.
    header = {sm.K_TYPE: sm.T_OPEN, sm.K_SEQ: 0, sm.K_SIZE: _HUGE_PAYLOAD}
    return d.case(_stage_raw(header, d.blob(0, 1 << 20)), eof=d.rng.random() < 0.5)


@_case(STAGE_LABEL, "stage.reply_kinds_upstream")
def _(d: Draw) -> Case:
    msg = d.pick(sm.Token(0, 1), sm.StageFailure(None, "hostile"), sm.StageFailure(0, "x"))
    return d.case(sm.encode(msg))


@_case(STAGE_LABEL, "stage.wrong_types")
def _(d: Draw) -> Case:
    header = d.pick(
        {sm.K_TYPE: sm.T_CLOSE, sm.K_SEQ: "0"},
        {sm.K_TYPE: sm.T_CLOSE, sm.K_SEQ: 1.5},
        {sm.K_TYPE: sm.T_CLOSE, sm.K_SEQ: True},
        {sm.K_TYPE: "close", sm.K_SEQ: 0},
        {sm.K_TYPE: sm.T_OPEN, sm.K_SEQ: 0, sm.K_SAMPLING: [0.0]},
        {sm.K_TYPE: sm.T_DROP, sm.K_ENTRIES: "all"},
        {sm.K_TYPE: sm.T_OPEN, sm.K_SEQ: 0, sm.K_SIZE: -1},
    )
    return d.case(_stage_raw(header))


@_case(STAGE_LABEL, "stage.open_and_leave")
def _(d: Draw) -> Case:
    return d.case(sm.encode(sm.Open(d.rng.randrange(d.k.slots), _greedy())), eof=False, wait=2.0)


_framed("reply", REPLY_LABEL, sm.FRAMING, lambda d: sm.encode(sm.Token(0, 1)))


@_case(REPLY_LABEL, "reply.token_seq")
def _(d: Draw) -> Case:
    return d.case(sm.encode(sm.Token(d.bad_int(d.k.slots), 1)))


@_case(REPLY_LABEL, "reply.token_id")
def _(d: Draw) -> Case:
    token = d.bad_int(d.k.vocab, d.k.vocab + 1)
    return d.case(sm.encode(sm.Token(d.rng.randrange(d.k.slots), token)))


@_case(REPLY_LABEL, "reply.token_injected")
def _(d: Draw) -> Case:
    # A token in range for a slot that may hold someone's request: text in their completion.
    tokens = [sm.Token(s, d.rng.randrange(d.k.vocab)) for s in range(d.k.slots)]
    return d.case(b"".join(sm.encode(t) for t in tokens))


@_case(REPLY_LABEL, "reply.draft_ids")
def _(d: Draw) -> Case:
    more = tuple(d.pick(d.k.vocab, 2**31, 2**63) for _ in range(d.rng.randint(1, 4)))
    return d.case(sm.encode(sm.Token(d.rng.randrange(d.k.slots), 1, more=more)))


@_case(REPLY_LABEL, "reply.failure")
def _(d: Draw) -> Case:
    seq = d.pick(None, 0, d.bad_int(d.k.slots))
    if seq is not None and seq < 0:
        seq = 2**63
    return d.case(sm.encode(sm.StageFailure(seq, "a hostile stage failed")))


@_case(REPLY_LABEL, "reply.logprobs")
def _(d: Draw) -> Case:
    header = {
        sm.K_TYPE: sm.T_TOKEN,
        sm.K_SEQ: 0,
        sm.K_TOKEN: 1,
        sm.K_LOGPROBS: [[0.0, [[d.bad_int(d.k.vocab), -1.0]] * d.rng.randint(1, 30)]],
    }
    return d.case(_stage_raw(header))


@_case(REPLY_LABEL, "reply.upstream_kinds")
def _(d: Draw) -> Case:
    msg = d.pick(sm.Open(0, _greedy()), sm.Close(0), sm.Drop((1,)))
    return d.case(sm.encode(msg))


# -- gossip/1: anti-entropy exchanges and the signed items they carry


def _gossip_frame(data: bytes) -> gossip.Message | None:
    frames = LengthPrefixDecoder(gossip.FRAMING, data)
    body = frames.next_frame()
    return None if body is None else gossip.decode(body)


def _obituary(d: Draw, subject: str, beat: int) -> bytes:
    if 0 <= beat < 2**64:
        return Obituary.sign(d.identity(), subject, beat, d.k.mesh).to_cbor()
    # Beyond a u64 nothing can be signed: the item carries the value and any signature.
    return cbor2.dumps({0: 1, 1: subject, 2: beat, 3: bytes(32), 4: bytes(64)})


def _huge_beat(d: Draw) -> int:
    return d.pick(2**64 - 1, 2**64 - 2, 2**63, 2**64, -1, 10**15)


def _final(items: gossip.Items, wants: tuple[gossip.DigestEntry, ...] = ()) -> bytes:
    return gossip.encode(gossip.Delta(items, wants))


def _beats_in(answer: bytes) -> dict[str, int]:
    """The heartbeats an agent's delta carries: peer id -> beat."""
    msg = _gossip_frame(answer)
    out: dict[str, int] = {}
    if isinstance(msg, gossip.Delta):
        for raw in msg.items.beats:
            try:
                hb = Heartbeat.decode(raw)
            except MeshError:
                continue
            out[hb.peer_id] = hb.beat
    return out


def _exchange(d: Draw, final: Callable[[bytes], bytes | None], **kw: Any) -> Case:
    """An exchange begun with an empty digest (the agent answers with everything it holds),
    ended with `final(its answer)`. Often under a fresh identity: the agent rate-limits
    exchanges per peer."""
    digest = gossip.encode(gossip.Digest(()))
    kw.setdefault("fresh", d.rng.random() < 0.3)
    # The agent drops bad items and ends the exchange as usual: an answer is no breach.
    kw.setdefault("refuse", False)
    return d.case(digest, eof=False, then=final, **kw)


# The receiver's limit, not the u32's.
_framed(
    "gossip",
    GOSSIP_LABEL,
    gossip.framing(GossipConfig().max_message),
    lambda d: gossip.encode(gossip.Digest(())),
)


@_case(GOSSIP_LABEL, "gossip.obituary_huge_beat")
def _(d: Draw) -> Case:
    subject = d.pick(d.target, d.other())
    obit = _obituary(d, subject, _huge_beat(d))
    return _exchange(d, lambda _: _final(gossip.Items(obituaries=(obit,))))


@_case(GOSSIP_LABEL, "gossip.obituary_plausible")
def _(d: Draw) -> Case:
    # The subject declared dead at the beat it last sent: what a peer that lost it says.
    subject = d.other()
    reporter = d.identity()

    def final(answer: bytes) -> bytes:
        beat = _beats_in(answer).get(subject, 1) + 1
        obit = Obituary.sign(reporter, subject, beat, d.k.mesh).to_cbor()
        return _final(gossip.Items(obituaries=(obit,)))

    return _exchange(d, final)


@_case(GOSSIP_LABEL, "gossip.heartbeat_huge")
def _(d: Draw) -> Case:
    beat = d.pick(2**64 - 1, 2**63, 10**15)
    hb = Heartbeat.sign(d.identity(), beat, d.k.mesh).to_cbor()
    return _exchange(d, lambda _: _final(gossip.Items(beats=(hb,))))


@_case(GOSSIP_LABEL, "gossip.heartbeats_of_strangers")
def _(d: Draw) -> Case:
    # Peers that do not exist, each signed for: a member table filled with nobody.
    n = d.pick(16, 64, 256)
    beats = tuple(
        Heartbeat.sign(d.identity(), d.rng.randrange(2**40), d.k.mesh).to_cbor() for _ in range(n)
    )
    return _exchange(d, lambda _: _final(gossip.Items(beats=beats)))


def _bad_items(d: Draw) -> gossip.Items:
    """Items of one kind that are not what they say: garbage, maps with keys missing or of
    the wrong type, signatures of nobody."""
    kind = d.pick("records", "beats", "obituaries")
    items = tuple(
        d.pick(
            d.blob(1, 600),
            cbor2.dumps({0: 1, 1: d.blob(0, 100), 2: bytes(64)}),
            cbor2.dumps({0: 1, 3: b"", 4: b""}),
            cbor2.dumps({0: 1, 1: bytes(32), 2: d.bad_int(), 3: bytes(64)}),
            cbor2.dumps({0: 1, 1: "x" * 65, 2: 1, 3: bytes(32), 4: bytes(64)}),
            cbor2.dumps({0: 1, 1: cbor2.dumps({0: 1, 1: 7}), 2: bytes(64)}),
            cbor2.dumps({0: 1, 1: 7, 2: "sig"}),
            b"",
        )
        for _ in range(d.rng.randint(1, 64))
    )
    return gossip.Items(**{kind: items})


@_case(GOSSIP_LABEL, "gossip.bad_items")
def _(d: Draw) -> Case:
    items = _bad_items(d)
    return _exchange(d, lambda _: _final(items))


@_case(GOSSIP_LABEL, "gossip.too_many_items")
def _(d: Draw) -> Case:
    items = tuple(d.blob(400, 600) for _ in range(gossip.MAX_ITEMS))
    return _exchange(d, lambda _: _final(gossip.Items(records=items)))


@_case(GOSSIP_LABEL, "gossip.wants_in_final")
def _(d: Draw) -> Case:
    wants = (gossip.DigestEntry(d.target, 1, 1),)
    return _exchange(d, lambda _: _final(gossip.Items(), wants))


@_case(GOSSIP_LABEL, "gossip.digest")
def _(d: Draw) -> Case:
    def entry() -> gossip.DigestEntry:
        peer = d.pick(d.target, d.other(), d.rng.randbytes(20).hex()[:26], "x" * 65, "")
        return gossip.DigestEntry(peer, d.bad_int(), d.bad_int(), d.pick(True, False, 1))

    n = d.pick(1, 16, gossip.MAX_DIGEST_ENTRIES, gossip.MAX_DIGEST_ENTRIES + 1)
    digest = gossip.encode(gossip.Digest(tuple(entry() for _ in range(n))))
    return d.case(digest, eof=False, then=lambda _: _final(gossip.Items()), fresh=True)


@_case(GOSSIP_LABEL, "gossip.out_of_turn")
def _(d: Draw) -> Case:
    msg = d.pick(gossip.Delta(gossip.Items()), gossip.Busy("hostile"))
    return d.case(gossip.encode(msg))


# -- artifact/1 and header/1: what a peer asks of another's files


_framed("artifact", transfer.LABEL, transfer.FRAMING, lambda d: _artifact_get("slice", 0))


def _artifact_get(key: Any, first: Any) -> bytes:
    fields = {0: transfer.VERSION, transfer.K_TYPE: transfer.T_GET, transfer.K_KEY: key}
    if first is not None:
        fields[transfer.K_FROM] = first
    return _cbor_frame(transfer.FRAMING, fields)


@_case(transfer.LABEL, "artifact.key")
def _(d: Draw) -> Case:
    key = d.pick(
        7,
        None,
        b"bytes",
        ["a"],
        "../../../../etc/passwd",
        "/etc/passwd",
        "\x00",
        "x" * 500_000,
        f"{d.k.model}:0-{d.bad_int(d.k.layers)}",
        f"{d.k.model}:{d.rng.randrange(d.k.layers)}-{d.rng.randrange(d.k.layers)}",
    )
    return d.case(_artifact_get(key, None))


@_case(transfer.LABEL, "artifact.first_chunk")
def _(d: Draw) -> Case:
    first = d.pick("abc", 1.5, math.inf, math.nan, [1], d.bad_int())
    return d.case(_artifact_get("any", first))


@_case(transfer.LABEL, "artifact.not_a_get")
def _(d: Draw) -> Case:
    kind = d.pick(transfer.T_HEADER, transfer.T_ERROR, 99, "get", None)
    return d.case(_cbor_frame(transfer.FRAMING, {0: transfer.VERSION, transfer.K_TYPE: kind}))


_framed("header", header_share.LABEL, header_share.FRAMING, lambda d: _header_ask("0" * 64))


def _header_ask(sha: Any) -> bytes:
    return _cbor_frame(header_share.FRAMING, {0: header_share.VERSION, header_share.K_SHA256: sha})


@_case(header_share.LABEL, "header.sha256")
def _(d: Draw) -> Case:
    sha = d.pick(d.rng.randbytes(32).hex(), "0" * 63, 7, None, b"\x00" * 32, "../" * 21 + "x")
    return d.case(_header_ask(sha))


# -- probe/1 and hear/1: what any member may ask, and the labels no agent serves


@_case(probe.LABEL, "probe.bytes")
def _(d: Draw) -> Case:
    return d.case(d.blob(0, 256 * 1024), refuse=False)


@_case(probe.LABEL, "probe.left_open")
def _(d: Draw) -> Case:
    return d.case(d.blob(0, 64 * 1024), eof=False, wait=d.hold())


@_case(hearing.LABEL, "hear.about")
def _(d: Draw) -> Case:
    about = d.pick(d.other(), d.target, "nobody")
    return d.case(label=f"{hearing.LABEL}:{about}", refuse=False)


@_case(hearing.LABEL, "hear.bad_label")
def _(d: Draw) -> Case:
    label = d.pick(hearing.LABEL, f"{hearing.LABEL}:", f"{hearing.LABEL}:" + "x" * 200)
    return d.case(label=label)


@_case(hearing.LABEL, "hear.with_body")
def _(d: Draw) -> Case:
    return d.case(d.blob(1, 1024), label=f"{hearing.LABEL}:{d.other()}")


@_case(OTHER, "other.label")
def _(d: Draw) -> Case:
    label = d.pick("", "nope/1", "stage/2", "gossip", ":", "\x00", "api/1x", "x" * MAX_LABEL_LEN)
    return d.case(d.blob(0, 64), label=label)


# -- connections: many identities, another mesh, no handshake at all


@_case(CONNECT, "connect.many_identities")
def _(d: Draw) -> Case:
    return d.case(kind="members", members=d.rng.randint(4, 16), refuse=False)


@_case(CONNECT, "connect.other_mesh")
def _(d: Draw) -> Case:
    return d.case(kind="stranger")


@_case(CONNECT, "connect.no_handshake")
def _(d: Draw) -> Case:
    data = d.pick(b"", d.blob(1, 4096), b"\x00" * 4 + d.blob(0, 64), b"\xff" * 4)
    return d.case(data, kind="raw", wait=d.pick(0.5, 2.0))


# ----- reading answers -----------------------------------------------------------------------


def _first_frame(framing: Framing, data: bytes) -> bytes | None:
    try:
        return LengthPrefixDecoder(replace(framing, max_size=(1 << 32) - 1), data).next_frame()
    except MeshError:
        return None


def _cbor_map(body: bytes) -> dict[Any, Any] | None:
    try:
        m = cbor2.loads(body)
    except Exception:  # cbor2 raises several unrelated types on garbage
        return None
    return m if isinstance(m, dict) else None


def _gen_answer(data: bytes, final: bool) -> tuple[str, str] | None:
    body = _first_frame(gm.FRAMING, data)
    if body is None:
        return (ANSWERED, "an unreadable answer") if final and data else None
    try:
        msg = gm.decode(body)
    except gm.GenMessageError:
        return ANSWERED, "an unreadable answer"
    if isinstance(msg, gm.Fail):
        return REFUSED, f"HTTP {msg.error.status}: {msg.error.message}"
    return ANSWERED, type(msg).__name__.lower()


def _map_answer(framing: Framing, error_key: int, data: bytes, final: bool):
    body = _first_frame(framing, data)
    if body is None:
        return (ANSWERED, "an unreadable answer") if final and data else None
    m = _cbor_map(body) or {}
    if error_key in m:
        return REFUSED, str(m[error_key])
    return ANSWERED, "an answer"


def _gossip_answer(data: bytes, final: bool) -> tuple[str, str] | None:
    try:
        msg = _gossip_frame(data)
    except MeshError:
        return ANSWERED, "an unreadable answer"
    if msg is None:
        return (ANSWERED, "an unreadable answer") if final and data else None
    if isinstance(msg, gossip.Busy):
        return REFUSED, f"busy: {msg.reason}"
    return ANSWERED, type(msg).__name__.lower()


def _sized_answer(size: int, data: bytes, final: bool) -> tuple[str, str] | None:
    if len(data) >= size:
        return ANSWERED, "an answer"
    return (ANSWERED, "a short answer") if final and data else None


def _any_answer(data: bytes, final: bool) -> tuple[str, str] | None:
    return (ANSWERED, "bytes back") if final and data else None


_ANSWERS: dict[str, Callable[[bytes, bool], tuple[str, str] | None]] = {
    GENERATE_LABEL: _gen_answer,
    GOSSIP_LABEL: _gossip_answer,
    transfer.LABEL: lambda data, final: _map_answer(
        transfer.FRAMING, transfer.K_ERROR, data, final
    ),
    header_share.LABEL: lambda data, final: _map_answer(
        header_share.FRAMING, header_share.K_ERROR, data, final
    ),
    probe.LABEL: lambda data, final: _sized_answer(40, data, final),
    hearing.LABEL: lambda data, final: _sized_answer(4, data, final),
}


def answer_of(label: str, data: bytes, *, final: bool) -> tuple[str, str] | None:
    """What the bytes an agent sent back on a `label` stream say: (outcome, reason), or None
    while a first message is not whole (`final`: nothing more will come)."""
    return _ANSWERS.get(label.split(":", 1)[0], _any_answer)(data, final)


_PEER_ID = re.compile(r"\b[a-z2-7]{26}\b")
_NUMBER = re.compile(r"\d+")


def _reason(text: str) -> str:
    """A reason as counted: peer ids and numbers made alike, cut to a line."""
    text = _NUMBER.sub("N", _PEER_ID.sub("<peer>", text.replace("\n", " ")))
    return text[:160]


# ----- playing cases -------------------------------------------------------------------------


class HostileMember:
    """Plays `cases(seed, ...)` against `agents` (each joined once, with a fixed identity;
    some cases bring fresh ones) and answers their gossip with forged items. `tally` holds
    what happened so far."""

    def __init__(
        self,
        agents: Sequence[AgentAddress],
        knowledge: Knowledge | None = None,
        *,
        seed: int = 0,
        deadline: float = 1.0,
        skip: Sequence[str] = (),
    ) -> None:
        for a in agents:
            if not is_loopback(Address.parse(a.overlay).host):
                raise ValueError(f"a hostile member attacks loopback agents only, not {a.overlay}")
        if not agents:
            raise ValueError("a hostile member needs an agent to attack")
        self.agents = {a.peer_id: a for a in agents}
        k = knowledge or Knowledge()
        self.knowledge = replace(k, mesh=mesh_fingerprint(agents[0].mesh), peers=tuple(self.agents))
        self.seed = seed
        self.deadline = deadline
        self.skip = tuple(skip)
        self.tally = Tally()
        self._members: dict[str, Member] = {}
        self._in_flight: dict[int, tuple[str, str]] = {}  # case number -> (target, name)
        self._answer_rng = random.Random(seed + 1)

    async def run(
        self,
        *,
        count: int | None = None,
        seconds: float | None = None,
        rate: float = 60.0,
        concurrency: int = 64,
    ) -> Tally:
        """Start a case every 1/`rate` seconds (at most `concurrency` at once) until `count`
        cases or `seconds` have passed, then wait for those under way."""
        if count is None and seconds is None:
            raise ValueError("give a number of cases or a duration")
        drawn = cases(self.seed, self.knowledge, list(self.agents), skip=self.skip)
        limit = trio.CapacityLimiter(concurrency)
        async with AsyncExitStack() as stack:
            for peer, agent in self.agents.items():
                join = Member.join(agent, on_stream=self._answer, config=_FAST)
                self._members[peer] = await stack.enter_async_context(join)
            start = self.tally.started = trio.current_time()
            async with trio.open_nursery() as watching:
                watching.start_soon(self._watch_lag)
                async with trio.open_nursery() as nursery:
                    n = 0
                    while (count is None or n < count) and (
                        seconds is None or trio.current_time() - start < seconds
                    ):
                        await trio.sleep_until(start + n / rate)
                        await limit.acquire_on_behalf_of(n)
                        target, case = next(drawn)
                        nursery.start_soon(self._play, target, case, limit, n)
                        self.tally.last_sent = trio.current_time()
                        n += 1
                watching.cancel_scope.cancel()
            self.tally.ended = trio.current_time()
        return self.tally

    async def _watch_lag(self, period: float = 0.05) -> None:
        while True:
            due = trio.current_time() + period
            await trio.sleep_until(due)
            self.tally.max_lag = max(self.tally.max_lag, trio.current_time() - due)

    async def _play(self, target: str, case: Case, limit: trio.CapacityLimiter, n: int) -> None:
        began = trio.current_time()
        self._in_flight[n] = (target, case.name)
        try:
            wait = case.wait if case.wait is not None else self.deadline
            outcome, why = SILENT, ""
            with trio.move_on_after(wait + 10):  # sending included: flow control may stall
                outcome, why = await self._attempt(target, case)
            if outcome == LOST and target not in self.tally.first_lost:
                self.tally.first_lost[target] = {
                    "case": case.name,
                    "reason": why,
                    "in_flight": sorted(nm for t, nm in self._in_flight.values() if t == target),
                }
        finally:
            del self._in_flight[n]
            limit.release_on_behalf_of(n)
        # Silence breaches only where the case said all it had to (a stream left open may be
        # waited on).
        breach = case.refuse and (outcome == ANSWERED or (outcome == SILENT and case.eof))
        r = Result(
            target,
            case.counted_as,
            case.name,
            outcome,
            _reason(why),
            case.size,
            trio.current_time() - began,
            breach,
        )
        self.tally.record(r)

    async def _attempt(self, target: str, case: Case) -> tuple[str, str]:
        agent = self.agents[target]
        if case.kind == "raw":
            return await self._raw(agent, case)
        if case.kind == "stranger":
            stranger = replace(agent, mesh=MeshSecret.generate())
            try:
                async with Member.join(stranger, config=_FAST):
                    return ANSWERED, "a handshake under another mesh's secret"
            except (MeshError, OSError) as e:
                return REFUSED, str(e)
        if case.kind == "members":
            return await self._many(agent, case.members)
        if case.fresh:
            try:
                async with Member.join(agent, config=_FAST) as member:
                    return await self._stream(member, case)
            except (MeshError, OSError) as e:
                return UNREACHABLE, str(e)
        member = self._members[target]
        try:
            await member.redial()
        except (MeshError, OSError) as e:
            return UNREACHABLE, str(e)
        return await self._stream(member, case)

    async def _stream(self, member: Member, case: Case) -> tuple[str, str]:
        try:
            stream = await member.open(case.label)
        except ConnectionUnavailable as e:
            return LOST, str(e)
        try:
            return await self._converse(stream, case)
        except StreamResetError as e:
            if e.by_peer:
                return RESET, f"{e.code.name}: {e.reason}"
            return LOST, e.reason
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            return LOST, str(e) or type(e).__name__
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _converse(self, stream: MeshStream, case: Case) -> tuple[str, str]:
        for chunk in case.send:
            await stream.send_all(chunk)
        if case.eof and case.then is None:
            await stream.send_eof()
        data, then, ended = bytearray(), case.then, False
        wait = case.wait if case.wait is not None else self.deadline
        with trio.move_on_after(wait):
            while True:
                chunk = await stream.receive_some()
                if not chunk:
                    ended = True
                    break
                if len(data) < _KEEP:
                    data += chunk
                found = answer_of(case.label, bytes(data), final=False)
                if found is not None and then is not None:
                    reply = then(bytes(data))
                    then = None
                    if reply:
                        await stream.send_all(reply)
                    await stream.send_eof()
                elif found is not None and case.then is None:
                    return found
        if data:
            found = answer_of(case.label, bytes(data), final=True)
            if found is not None:
                return found
        return (CLOSED, "the agent ended the stream") if ended else (SILENT, "")

    async def _many(self, agent: AgentAddress, n: int) -> tuple[str, str]:
        try:
            async with AsyncExitStack() as stack:
                for _ in range(n):
                    await stack.enter_async_context(Member.join(agent, config=_FAST))
                await trio.sleep(0.5)
        except (MeshError, OSError) as e:
            return REFUSED, str(e)
        return ANSWERED, "every identity connected"

    async def _raw(self, agent: AgentAddress, case: Case) -> tuple[str, str]:
        address = Address.parse(agent.overlay)
        try:
            tcp = await trio.open_tcp_stream(address.host, address.port)
        except OSError as e:
            return UNREACHABLE, str(e)
        async with tcp:
            try:
                for chunk in case.send:
                    await tcp.send_all(chunk)
                with trio.move_on_after(case.wait or self.deadline):
                    while await tcp.receive_some(65536):
                        pass
                    return CLOSED, "the agent closed the connection"
            except (trio.BrokenResourceError, OSError) as e:
                return RESET, str(e) or type(e).__name__
        return SILENT, ""

    # -- the gossip exchanges agents start with the member

    async def _answer(self, stream: MeshStream) -> None:
        """Streams an agent opens to the member: its gossip exchanges get forged items, its
        `hear/1` questions a made-up answer; the rest is refused."""
        if stream.label == GOSSIP_LABEL:
            await self._answer_gossip(stream)
        elif stream.label.startswith(f"{hearing.LABEL}:") and not _skipped(
            "hear.answer", self.skip
        ):
            # As if the peer asked about were gone (or heard from a moment ago), or garbage.
            reply = self._answer_rng.choice(
                (hearing.reply(None), hearing.reply(3600.0), hearing.reply(0.0), b"\xff" * 9)
            )
            began = trio.current_time()
            outcome, why = ANSWERED, "the agent read the answer"
            try:
                await stream.send_all(reply)
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                outcome, why = LOST, str(e)
            took = trio.current_time() - began
            r = Result(stream.peer_id, hearing.LABEL, "hear.answer", outcome, why, 4, took, False)
            self.tally.record(r)
        else:
            stream.reset("a hostile member serves nothing")

    async def _answer_gossip(self, stream: MeshStream) -> None:
        """Answer an agent's exchange with a delta of forged items (counted like a case)."""
        began = trio.current_time()
        rng = self._answer_rng
        kinds = [k for k in _ANSWER_KINDS if not _skipped(f"gossip.answer.{k}", self.skip)]
        if not kinds:
            stream.reset("a hostile member answers no exchange")
            return
        kind = rng.choice(kinds)
        name = f"gossip.answer.{kind}"
        outcome, why, sent = SILENT, "", 0
        try:
            with trio.move_on_after(self.deadline * 5):
                frames = LengthPrefixDecoder(gossip.FRAMING)
                while (body := frames.next_frame()) is None:
                    chunk = await stream.receive_some()
                    if not chunk:
                        raise trio.BrokenResourceError("the agent ended its exchange")
                    frames.feed(chunk)
                digest = gossip.decode(body)
                reply = _forged_delta(rng, self.knowledge, stream.peer_id, kind, digest)
                sent = len(reply)
                await stream.send_all(reply)
                while await stream.receive_some():
                    pass
                await stream.send_eof()
                outcome, why = ANSWERED, "the agent took the delta"
        except StreamResetError as e:
            outcome, why = (RESET, f"{e.code.name}: {e.reason}") if e.by_peer else (LOST, e.reason)
        except (trio.BrokenResourceError, trio.ClosedResourceError, MeshError) as e:
            outcome, why = LOST, str(e)
        r = Result(
            stream.peer_id,
            GOSSIP_LABEL,
            name,
            outcome,
            _reason(why),
            sent,
            trio.current_time() - began,
            False,  # the agent drops a bad item and ends the exchange as usual
        )
        self.tally.record(r)


def _forged_delta(
    rng: random.Random, k: Knowledge, agent: str, kind: str, digest: gossip.Message
) -> bytes:
    """The responder's delta of an exchange `agent` started: one forged item of `kind`."""
    d = Draw(rng, k, agent, tuple(p for p in k.peers if p != agent), GOSSIP_LABEL, kind)
    beats = {e.peer_id: e.beat for e in digest.entries} if isinstance(digest, gossip.Digest) else {}
    if kind == "obituary_self":
        item = _obituary(d, agent, d.pick(2**64 - 1, 2**64 - 2, 2**63))
    elif kind == "obituary_other":
        item = _obituary(d, d.other(), d.pick(2**64 - 1, 2**64 - 2, 2**63))
    elif kind == "obituary_plausible":
        subject = d.other()
        item = _obituary(d, subject, beats.get(subject, 1) + 1)
    elif kind == "bad_items":
        return _final(_bad_items(d))
    else:
        hb = Heartbeat.sign(d.identity(), 2**64 - 1, k.mesh).to_cbor()
        return _final(gossip.Items(beats=(hb,)))
    return _final(gossip.Items(obituaries=(item,)))


_ANSWER_KINDS = ("obituary_self", "obituary_other", "obituary_plausible", "heartbeat", "bad_items")


def _skipped(name: str, skip: Sequence[str]) -> bool:
    return any(name.startswith(s) for s in skip)
