"""Capability records: what certification measured for one model file, signed by the agent
that measured it.

A record names the model by the sha256 of its GGUF file and says how the family behaves when
split (layer types, how its per-sequence state is kept) and, per wire dtype, how far a split's
logits are from the whole model's on the certification prompts. Placement reads only
`exact_dtypes`: a wire dtype is used by default only where the record says a split with it
gave the whole model's greedy output on every prompt and cut tried.

On disk and on the wire a record is CBOR `{0: version, 1: body, 2: public key, 3: signature}`;
the signature covers a context string and the body, and the body is the record's own CBOR.
Decoding verifies: a record that decodes is the one its signer wrote. Any member can sign a
record naming itself, so the body is checked too, every field once, at decode (`from_dict`):
a value out of its range is a ModelError naming the field.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import cbor2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from meshagent.errors import ModelError
from meshagent.identity.keys import NodeIdentity, peer_id_for
from meshagent.wire.quoted import quoted

RECORD_VERSION = 1
MAX_SIGNED_BYTES = 8 * 1024
_CONTEXT = b"meshagent/capability-record/v1\x00"
STATE_KINDS = ("kv", "recurrent", "hybrid")
LAYER_TYPES = ("attention", "recurrent", "unknown")  # models/family.py
# The ranges of what a record holds.
LAYERS = range(1, 1 << 16)
COUNTS = range(2**31)  # positions compared, tokens of context
MAX_TEXT = 255
MAX_WIRE = 16  # wire dtypes measured
MAX_DTYPE = 16
MAX_CUTS = 64
MAX_PROMPTS = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class WireResult:
    """One wire dtype's measurements over every prompt and cut."""

    dtype: str
    top1_agreement: float  # teacher-forced: share of positions whose argmax matches whole
    max_logit_diff: float  # largest |staged - whole| over all positions and logits
    greedy_identical: bool  # every prompt's greedy text identical to the whole model's
    chunked_prefill_identical: bool  # prefill in chunks gives the one-shot prefill's logits
    positions: int  # positions compared
    # Real agent processes split the model with this dtype and answered as one whole agent:
    # True or False where the soak ran with this dtype, None where it did not.
    soak_identical: bool | None = None

    @property
    def exact(self) -> bool:
        return (
            self.greedy_identical
            and self.chunked_prefill_identical
            and self.soak_identical is not False
        )

    @classmethod
    def from_dict(cls, w: Any) -> WireResult:
        """One dtype's measurements from a record's body (`exact` is derived, not read)."""
        if not isinstance(w, dict):
            raise ModelError(f"capability record field 'wire' holds {quoted(w)}, not a map")
        _known_keys(w, _WIRE_FIELDS | {"exact"}, "capability record field 'wire'")
        dtype = _text(w, "dtype")
        if not 0 < len(dtype) <= MAX_DTYPE:
            raise ModelError(f"capability record field 'dtype' is {quoted(dtype)}")
        top1 = _number(w, "top1_agreement")
        if not 0.0 <= top1 <= 1.0:
            raise ModelError(
                f"capability record field 'top1_agreement' is {quoted(top1)}, not a share of 0-1"
            )
        diff = _number(w, "max_logit_diff")
        if not diff >= 0.0:  # NaN too
            raise ModelError(
                f"capability record field 'max_logit_diff' is {quoted(diff)}, not a distance"
            )
        soak = w.get("soak_identical")
        if soak is not None and type(soak) is not bool:
            raise ModelError(
                f"capability record field 'soak_identical' is {quoted(soak)}, not true, false "
                "or null"
            )
        return cls(
            dtype=dtype,
            top1_agreement=top1,
            max_logit_diff=diff,
            greedy_identical=_bool(w, "greedy_identical"),
            chunked_prefill_identical=_bool(w, "chunked_prefill_identical"),
            positions=_int(w, "positions", COUNTS),
            soak_identical=soak,
        )


@dataclass(frozen=True)
class CapabilityRecord:
    model_sha256: str
    model_name: str
    architecture: str
    n_layers: int
    splittable: bool
    layer_types: tuple[str, ...]  # per layer: "attention" or "recurrent"
    state_kind: str  # "kv", "recurrent" or "hybrid"
    state_portable: bool  # per-sequence state can be exported from one engine and imported
    cuts: tuple[tuple[int, ...], ...]  # the stage boundaries certified, e.g. (0, 15, 30)
    wire: tuple[WireResult, ...]
    certified_ctx: int  # longest context the prompts reached, in tokens
    llama_cpp_version: str
    certifier: str  # peer id of the agent that signed it
    certified_at: float  # unix time
    prompts: tuple[str, ...] = field(default=())  # names of the certification prompts
    version: int = RECORD_VERSION

    def exact_dtypes(self) -> tuple[str, ...]:
        return tuple(w.dtype for w in self.wire if w.exact)

    def result(self, dtype: str) -> WireResult | None:
        return next((w for w in self.wire if w.dtype == dtype), None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for w, wd in zip(self.wire, d["wire"], strict=True):
            wd["exact"] = w.exact
        return d

    @classmethod
    def from_dict(cls, d: Any) -> CapabilityRecord:
        """The record a body holds; ModelError naming the first field out of its range."""
        if not isinstance(d, dict):
            raise ModelError(f"a capability record is a map, not {quoted(d)}")
        _version(d.get("version"))
        _known_keys(d, _RECORD_FIELDS, "capability record")
        n_layers = _int(d, "n_layers", LAYERS)
        layer_types = _list(d, "layer_types", n_layers)
        if len(layer_types) != n_layers or not all(t in LAYER_TYPES for t in layer_types):
            raise ModelError(
                f"capability record field 'layer_types' must list one of {LAYER_TYPES} for "
                f"each of the {n_layers} layers, not {quoted(layer_types)}"
            )
        state_kind = _text(d, "state_kind")
        if state_kind not in STATE_KINDS:
            raise ModelError(
                f"capability record field 'state_kind' is {quoted(state_kind)}, not one of "
                f"{STATE_KINDS}"
            )
        sha = _text(d, "model_sha256")
        if not _SHA256.fullmatch(sha):
            raise ModelError(
                f"capability record field 'model_sha256' is {quoted(sha)}, not a sha256 in hex"
            )
        return cls(
            model_sha256=sha,
            model_name=_text(d, "model_name"),
            architecture=_text(d, "architecture"),
            n_layers=n_layers,
            splittable=_bool(d, "splittable"),
            layer_types=tuple(layer_types),
            state_kind=state_kind,
            state_portable=_bool(d, "state_portable"),
            cuts=tuple(_cut(c, n_layers) for c in _list(d, "cuts", MAX_CUTS)),
            wire=tuple(WireResult.from_dict(w) for w in _list(d, "wire", MAX_WIRE)),
            certified_ctx=_int(d, "certified_ctx", COUNTS),
            llama_cpp_version=_text(d, "llama_cpp_version"),
            certifier=_text(d, "certifier"),
            certified_at=_unix_time(d, "certified_at"),
            prompts=tuple(
                _text_of(p, "prompts")
                for p in (_list(d, "prompts", MAX_PROMPTS) if "prompts" in d else ())
            ),
        )

    def sign(self, identity: NodeIdentity) -> SignedRecord:
        if self.certifier != identity.peer_id:
            raise ModelError("a capability record is signed by the agent it names")
        body = cbor2.dumps(self.to_dict(), canonical=True)
        return SignedRecord(self, body, identity.public_key, identity.sign(_CONTEXT + body))


@dataclass(frozen=True)
class SignedRecord:
    record: CapabilityRecord
    body: bytes
    public_key: bytes
    signature: bytes

    def to_bytes(self) -> bytes:
        return cbor2.dumps({0: RECORD_VERSION, 1: self.body, 2: self.public_key, 3: self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedRecord:
        """Decode and verify; ModelError for anything malformed, forged or tampered with."""
        if len(data) > MAX_SIGNED_BYTES:
            raise ModelError(f"capability record of {len(data)} bytes is over the limit")
        try:
            d = cbor2.loads(data)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise ModelError(f"capability record is not valid CBOR ({e})") from e
        if not isinstance(d, dict) or set(d) != {0, 1, 2, 3}:
            raise ModelError(f"capability record is malformed: {quoted(d)}")
        _version(d[0])
        body, key, sig = d[1], d[2], d[3]
        if not all(isinstance(x, bytes) for x in (body, key, sig)):
            raise ModelError("capability record is malformed: body, key and signature are bytes")
        try:
            VerifyKey(key).verify(_CONTEXT + body, sig)
        except (BadSignatureError, ValueError) as e:
            raise ModelError("capability record: bad signature (forged or tampered with)") from e
        try:
            fields_ = cbor2.loads(body)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise ModelError(f"capability record body is not valid CBOR ({e})") from e
        record = CapabilityRecord.from_dict(fields_)
        if record.certifier != peer_id_for(key):
            raise ModelError("capability record names a certifier other than its signer")
        return cls(record, body, key, sig)


_RECORD_FIELDS = frozenset(f.name for f in fields(CapabilityRecord))
_WIRE_FIELDS = frozenset(f.name for f in fields(WireResult))


def _known_keys(d: dict[Any, Any], known: frozenset[str], what: str) -> None:
    unknown = [k for k in d if k not in known]
    if unknown:
        raise ModelError(f"{what} has a field of no version of it: {quoted(unknown[0])}")


def _value(d: dict[Any, Any], name: Any) -> Any:
    if name not in d:
        raise ModelError(f"capability record lacks field {name!r}")
    return d[name]


def _version(v: Any) -> None:
    if type(v) is not int or v != RECORD_VERSION:  # True and 1.0 equal 1
        raise ModelError(f"capability record of version {quoted(v)}, not {RECORD_VERSION}")


def _int(d: dict[str, Any], name: str, allowed: range) -> int:
    v = _value(d, name)
    if type(v) is not int or v not in allowed:
        raise ModelError(
            f"capability record field {name!r} is {quoted(v)}, not an integer of "
            f"{allowed.start}-{allowed.stop - 1}"
        )
    return v


def _bool(d: dict[str, Any], name: str) -> bool:
    v = _value(d, name)
    if type(v) is not bool:
        raise ModelError(f"capability record field {name!r} is {quoted(v)}, not true or false")
    return v


def _text(d: dict[str, Any], name: str) -> str:
    return _text_of(_value(d, name), name)


def _text_of(v: Any, name: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise ModelError(
            f"capability record field {name!r} is {quoted(v)}, not text of at most "
            f"{MAX_TEXT} characters"
        )
    return v


def _number(d: dict[str, Any], name: str) -> float:
    v = _value(d, name)
    if type(v) is float or (type(v) is int and abs(v) < 2**53):
        return float(v)
    raise ModelError(f"capability record field {name!r} is {quoted(v)}, not a number")


def _unix_time(d: dict[str, Any], name: str) -> float:
    t = _number(d, name)
    if not 0.0 <= t < math.inf:
        raise ModelError(f"capability record field {name!r} is {quoted(t)}, not a unix time")
    return t


def _list(d: dict[str, Any], name: str, most: int) -> list[Any]:
    v = _value(d, name)
    if not isinstance(v, list) or len(v) > most:
        shown = f"{len(v)} items" if isinstance(v, list) else quoted(v)
        raise ModelError(
            f"capability record field {name!r} is {shown}, not a list of at most {most}"
        )
    return v


def _cut(c: Any, n_layers: int) -> tuple[int, ...]:
    """Stage boundaries: 0, then strictly rising, ending at the last layer."""
    if (
        not isinstance(c, list)
        or len(c) < 2
        or not all(type(b) is int for b in c)
        or c[0] != 0
        or c[-1] != n_layers
        or any(a >= b for a, b in itertools.pairwise(c))
    ):
        raise ModelError(
            f"capability record field 'cuts' holds {quoted(c)}, not stage boundaries from 0 "
            f"to {n_layers}"
        )
    return tuple(c)


class CapabilityStore:
    """Signed records in `root` (the artifact cache's `capabilities/`), one per model hash.

    Records certified here and records received from peers are kept alike; every one is
    verified when read, so a file changed on disk is refused, not trusted."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path_of(self, model_sha256: str) -> Path:
        return self.root / f"{model_sha256}.cbor"

    def put(self, signed: SignedRecord) -> Path:
        path = self.path_of(signed.record.model_sha256)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(signed.to_bytes())
        os.replace(tmp, path)
        return path

    def get(self, model_sha256: str) -> SignedRecord | None:
        """The record for a model; None if there is none. ModelError if it fails to verify."""
        try:
            data = self.path_of(model_sha256).read_bytes()
        except OSError:
            return None
        return SignedRecord.from_bytes(data)

    def all(self) -> list[SignedRecord]:
        """Every record that verifies (one that does not is skipped)."""
        out = []
        for p in sorted(self.root.glob("*.cbor")):
            try:
                out.append(SignedRecord.from_bytes(p.read_bytes()))
            except (OSError, ModelError):
                continue
        return out


# Cheapest first: bytes per value on the wire.
WIRE_ORDER = ("f16", "f32")


@dataclass(frozen=True)
class WireChoice:
    """The activations' dtype between a split's stages, and why."""

    dtype: str
    certified_exact: bool  # a capability record says this dtype gives the whole model's output
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_wire_dtype(flag: str, record: CapabilityRecord | None) -> WireChoice:
    """`flag` is `--wire-dtype`: "auto" takes the cheapest dtype the record certifies exact,
    and f32 when there is no record or none is certified; "f16" or "f32" is used as given."""
    exact = record.exact_dtypes() if record is not None else ()
    if flag != "auto":
        return WireChoice(flag, flag in exact, "set by --wire-dtype")
    for dtype in WIRE_ORDER:
        if dtype in exact:
            return WireChoice(dtype, True, "the cheapest dtype certified exact for this model")
    if record is None:
        return WireChoice("f32", False, "no certification record for this model: f32")
    return WireChoice("f32", False, "no wire dtype certified exact for this model: f32")
