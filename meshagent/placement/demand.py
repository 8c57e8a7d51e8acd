"""Demand for each model: requests and tokens over a sliding window, and when it expires.

Each agent meters the requests its API takes (`DemandMeter`: sans-IO, the caller passes
`now`), gossips what it measured in a compact CBOR form, and sums what the alive peers gossip
into the mesh's demand per model (`merge`, `gossiped`). The assignment of peers to models
(`assignment.py`) reads it.

Time is counted in buckets of `BUCKET_S` seconds numbered from the epoch of the clock the
caller passes (`now`): agents that pass their wall clock (`time.time()`) number the same
minute alike, so buckets from different peers add up by number. The window is the last
`BUCKETS` of them; older buckets are dropped.

Expiry follows ollama's `keep_alive`: a request's keep_alive sets the model's expiry to the
end of that request plus keep_alive (the last request to end sets it); 0 expires it at the
end of the request, a negative one never, none given `DEFAULT_KEEP_ALIVE_S` (5 minutes). A
model with a request in flight does not expire. The mesh's expiry of a model is the latest
any peer gossips.

Gossiped demand is read once, where it arrives (`from_cbor`): every value against a named
range, at most `MAX_MODELS` models and `BUCKETS + 1` buckets each; anything else is a
`DemandError` naming the value, and that peer's demand is left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from meshagent.errors import MeshError
from meshagent.gossip.failure import PeerState
from meshagent.wire.quoted import quoted

log = structlog.get_logger(__name__)

EXTRAS_KEY = "demand"  # this form's entry in the `extras` of a gossip record
DEMAND_VERSION = 1
BUCKET_S = 60.0
BUCKETS = 10
WINDOW_S = BUCKET_S * BUCKETS  # the sliding window: 10 minutes
SHORT_S = 2 * BUCKET_S  # the recent window the assignment grows replicas on
DEFAULT_KEEP_ALIVE_S = 300.0  # ollama's default
NEVER = math.inf  # the expiry of a model kept alive for ever (keep_alive < 0)

# The ranges of the gossiped form's values.
MAX_MODELS = 32
MAX_MODEL_ID = 255
BUCKET_INDEXES = range(2**40)
REQUESTS = range(2**32)  # per bucket
TOKENS = range(2**48)  # per bucket
IN_FLIGHT = range(2**16)
TIMES = (0.0, 2.0**40)  # seconds since the clock's epoch: [low, high)


class DemandError(MeshError):
    """A peer's gossiped demand is malformed."""


@dataclass(frozen=True)
class Bucket:
    """Requests begun and tokens of requests ended in one bucket of `BUCKET_S` seconds."""

    index: int  # floor(time / BUCKET_S)
    requests: int
    tokens: int


@dataclass(frozen=True)
class Demand:
    """One model's demand, one agent's or the mesh's."""

    buckets: tuple[Bucket, ...] = ()  # ascending index, each once
    last_used: float = 0.0  # when a request last began or ended (0: never)
    expires_at: float = 0.0  # when keep_alive runs out; NEVER for keep_alive < 0
    in_flight: int = 0  # requests begun and not ended

    def wanted(self, now: float) -> bool:
        """A request is in flight, or keep_alive has not run out."""
        return self.in_flight > 0 or self.expires_at > now

    def tokens_per_s(self, now: float, window: float = WINDOW_S) -> float:
        """Tokens per second over the `window` seconds before `now`."""
        return self._per_s(now, window, lambda b: b.tokens)

    def requests_per_s(self, now: float, window: float = WINDOW_S) -> float:
        """Requests per second over the `window` seconds before `now`."""
        return self._per_s(now, window, lambda b: b.requests)

    def peak_per_s(self, now: float, window: float = WINDOW_S) -> float:
        """The most tokens per second of one bucket that began within the `window` seconds
        before `now` (the one running counts for what it holds so far)."""
        start, top = now - window, 0.0
        for b in self.buckets:
            lo = b.index * BUCKET_S
            if start <= lo <= now:
                top = max(top, b.tokens / BUCKET_S)
        return top

    def _per_s(self, now: float, window: float, value: Any) -> float:
        # A bucket counts whole once it began within the window (its events all happened
        # before `now`); the one that began before the window counts for its part inside.
        # One fixed order of additions: the same buckets give the same float everywhere.
        start, total = now - window, 0.0
        for b in self.buckets:
            lo = b.index * BUCKET_S
            if lo > now or lo + BUCKET_S <= start:
                continue
            weight = 1.0 if lo >= start else (lo + BUCKET_S - start) / BUCKET_S
            total += weight * value(b)
        return total / window


def bucket_of(now: float) -> int:
    return math.floor(now / BUCKET_S)


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's `keep_alive` as seconds: a number of seconds, or a duration such as "5m",
    "1h30m", "90s", "-1"; None when not given. Raises DemandError on anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise DemandError(f"keep_alive {quoted(value)} is not a duration")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise DemandError(f"keep_alive {quoted(value)} is not a duration")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = None
        if seconds is not None and math.isfinite(seconds):
            return seconds
        m = _DURATION.fullmatch(text)
        if m is not None and text not in ("", "-"):
            sign = -1.0 if m.group(1) else 1.0
            parts = [float(x) if x else 0.0 for x in m.group(2, 3, 4, 5)]
            h, mins, s, ms = parts
            return sign * (h * 3600 + mins * 60 + s + ms / 1000)
    raise DemandError(f"keep_alive {quoted(value)} is not a duration (seconds, or like 5m)")


_DURATION = re.compile(
    r"(-)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?"
    r"(?:(\d+(?:\.\d+)?)ms)?"
)


@dataclass
class _Meter:
    buckets: dict[int, list[int]] = field(default_factory=dict)  # index: [requests, tokens]
    last_used: float = 0.0
    expires_at: float = 0.0
    in_flight: int = 0


class DemandMeter:
    """This agent's demand per model: what its API begins and ends, in buckets."""

    def __init__(self, *, default_keep_alive: float = DEFAULT_KEEP_ALIVE_S) -> None:
        self.default_keep_alive = default_keep_alive
        self._models: dict[str, _Meter] = {}

    def begin(self, model_id: str, *, now: float) -> None:
        """A request for `model_id` begins (its model is wanted until it ends)."""
        m = self._models.setdefault(model_id, _Meter())
        m.buckets.setdefault(bucket_of(now), [0, 0])[0] += 1
        m.in_flight += 1
        m.last_used = max(m.last_used, now)

    def end(
        self, model_id: str, *, now: float, tokens: int, keep_alive: float | None = None
    ) -> None:
        """A request ends having cost `tokens` (prompt and generated); its `keep_alive`
        (seconds; None: the default; 0: expire now; negative: never) sets the expiry."""
        m = self._models.setdefault(model_id, _Meter())
        m.buckets.setdefault(bucket_of(now), [0, 0])[1] += max(0, tokens)
        m.in_flight = max(0, m.in_flight - 1)
        m.last_used = max(m.last_used, now)
        wait = self.default_keep_alive if keep_alive is None else keep_alive
        m.expires_at = NEVER if wait < 0 else now + wait

    def demand(self, *, now: float) -> dict[str, Demand]:
        """Each model's demand now: buckets older than the window are dropped, and so is a
        model with no bucket left, nothing in flight and its keep_alive run out. At most
        `MAX_MODELS`, the most recently used."""
        oldest = bucket_of(now) - BUCKETS + 1
        out = {}
        for model_id, m in list(self._models.items()):
            for i in [i for i in m.buckets if i < oldest]:
                del m.buckets[i]
            if not m.buckets and m.in_flight == 0 and m.expires_at <= now:
                del self._models[model_id]
                continue
            buckets = tuple(Bucket(i, *m.buckets[i]) for i in sorted(m.buckets))
            out[model_id] = Demand(buckets, m.last_used, m.expires_at, m.in_flight)
        if len(out) > MAX_MODELS:
            kept = sorted(out, key=lambda k: (-out[k].last_used, k))[:MAX_MODELS]
            out = {k: out[k] for k in sorted(kept)}
        return out

    def to_cbor(self, *, now: float) -> dict[int, Any]:
        """What this agent gossips (`EXTRAS_KEY` in its record's extras)."""
        return to_cbor(self.demand(now=now))


def to_cbor(demand: Mapping[str, Demand]) -> dict[int, Any]:
    """The gossiped form: {0: version, 1: {model: [in flight, last used, expiry or None
    (never), [[bucket, requests, tokens], ...]]}}."""
    models = {}
    for model_id in sorted(demand):
        d = demand[model_id]
        models[model_id] = [
            d.in_flight,
            d.last_used,
            None if d.expires_at == NEVER else d.expires_at,
            [[b.index, b.requests, b.tokens] for b in d.buckets],
        ]
    return {0: DEMAND_VERSION, 1: models}


def from_cbor(raw: Any) -> dict[str, Demand]:
    """A peer's gossiped demand; DemandError naming the first value out of its range."""
    if not isinstance(raw, dict):
        raise DemandError(f"gossiped demand is a map, not {quoted(raw)}")
    version = raw.get(0)
    if type(version) is not int or version != DEMAND_VERSION:
        raise DemandError(f"gossiped demand of version {quoted(version)}, not {DEMAND_VERSION}")
    models = raw.get(1)
    if not isinstance(models, dict) or len(models) > MAX_MODELS:
        shown = f"{len(models)} of them" if isinstance(models, dict) else quoted(models)
        raise DemandError(f"gossiped demand's models ({shown}) are not a map of {MAX_MODELS}")
    out = {}
    for model_id, v in models.items():
        if not isinstance(model_id, str) or not 0 < len(model_id) <= MAX_MODEL_ID:
            raise DemandError(
                f"gossiped demand's model id {quoted(model_id)} is not text of "
                f"1-{MAX_MODEL_ID} characters"
            )
        if not isinstance(v, list) or len(v) != 4:
            raise DemandError(
                f"gossiped demand for {quoted(model_id)} is {quoted(v)}, not "
                "[in flight, last used, expiry, buckets]"
            )
        in_flight = _int(v[0], "in flight", IN_FLIGHT)
        last_used = _time(v[1], "last used")
        expires_at = NEVER if v[2] is None else _time(v[2], "expiry")
        out[model_id] = Demand(_buckets(v[3]), last_used, expires_at, in_flight)
    return out


def _int(v: Any, what: str, allowed: range) -> int:
    if type(v) is not int or v not in allowed:
        raise DemandError(
            f"gossiped demand's {what} is {quoted(v)}, not an integer of "
            f"{allowed.start}-{allowed.stop - 1}"
        )
    return v


def _time(v: Any, what: str) -> float:
    ok = type(v) is float or (type(v) is int and abs(v) < 2**53)
    if not ok or not TIMES[0] <= v < TIMES[1]:  # NaN compares false
        raise DemandError(
            f"gossiped demand's {what} is {quoted(v)}, not a time of "
            f"{TIMES[0]:.0f}-{TIMES[1]:.0f} seconds"
        )
    return float(v)


def _buckets(v: Any) -> tuple[Bucket, ...]:
    if not isinstance(v, list) or len(v) > BUCKETS + 1:
        shown = f"{len(v)} of them" if isinstance(v, list) else quoted(v)
        raise DemandError(
            f"gossiped demand's buckets ({shown}) are not a list of at most {BUCKETS + 1}"
        )
    out: list[Bucket] = []
    for b in v:
        if not isinstance(b, list) or len(b) != 3:
            raise DemandError(
                f"gossiped demand's bucket {quoted(b)} is not [bucket, requests, tokens]"
            )
        bucket = Bucket(
            _int(b[0], "bucket", BUCKET_INDEXES),
            _int(b[1], "bucket's requests", REQUESTS),
            _int(b[2], "bucket's tokens", TOKENS),
        )
        if out and bucket.index <= out[-1].index:
            raise DemandError(
                f"gossiped demand's bucket {bucket.index} follows bucket {out[-1].index}: "
                "buckets run in ascending order, each once"
            )
        out.append(bucket)
    return tuple(out)


def merge(parts: Iterable[Mapping[str, Demand]]) -> dict[str, Demand]:
    """The mesh's demand from each peer's: buckets of one number add up, requests in flight
    too; last used and expiry are the latest any peer says. Integers only are added, so
    the result does not depend on the order of `parts`. Models sorted by id."""
    buckets: dict[str, dict[int, list[int]]] = {}
    last: dict[str, float] = {}
    expiry: dict[str, float] = {}
    flight: dict[str, int] = {}
    for part in parts:
        for model_id, d in part.items():
            by_index = buckets.setdefault(model_id, {})
            for b in d.buckets:
                sums = by_index.setdefault(b.index, [0, 0])
                sums[0] += b.requests
                sums[1] += b.tokens
            last[model_id] = max(last.get(model_id, 0.0), d.last_used)
            expiry[model_id] = max(expiry.get(model_id, 0.0), d.expires_at)
            flight[model_id] = flight.get(model_id, 0) + d.in_flight
    return {
        m: Demand(
            tuple(Bucket(i, *buckets[m][i]) for i in sorted(buckets[m])),
            last[m],
            expiry[m],
            flight[m],
        )
        for m in sorted(buckets)
    }


def gossiped(views: Mapping[str, Any]) -> dict[str, Demand]:
    """The mesh's demand: what each alive peer gossips under `EXTRAS_KEY`, summed. A peer's
    form that does not decode is logged and left out."""
    parts = []
    for pid in sorted(views):
        view = views[pid]
        if view.state == PeerState.DEAD:
            continue
        raw = view.record.extras.get(EXTRAS_KEY)
        if raw is None:
            continue
        try:
            parts.append(from_cbor(raw))
        except DemandError as e:
            log.warning("placement.bad_demand", peer=pid, error=str(e))
    return merge(parts)
