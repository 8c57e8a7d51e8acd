"""Capability records: what certification measured for one model file, signed by the agent
that measured it.

A record names the model by the sha256 of its GGUF file and says how the family behaves when
split (layer types, how its per-sequence state is kept) and, per wire dtype, how far a split's
logits are from the whole model's on the certification prompts. Placement reads only
`exact_dtypes`: a wire dtype is used by default only where the record says a split with it
gave the whole model's greedy output on every prompt and cut tried.

On disk and on the wire a record is CBOR `{0: version, 1: body, 2: public key, 3: signature}`;
the signature covers a context string and the body, and the body is the record's own CBOR.
Decoding verifies: a record that decodes is the one its signer wrote.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cbor2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from meshagent.errors import ModelError
from meshagent.identity.keys import NodeIdentity, peer_id_for

RECORD_VERSION = 1
MAX_SIGNED_BYTES = 8 * 1024
_CONTEXT = b"meshagent/capability-record/v1\x00"
STATE_KINDS = ("kv", "recurrent", "hybrid")


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
    def from_dict(cls, d: dict[str, Any]) -> CapabilityRecord:
        if not isinstance(d, dict) or d.get("version") != RECORD_VERSION:
            raise ModelError("capability record of an unsupported version")
        try:
            wire = tuple(
                WireResult(**{k: v for k, v in w.items() if k != "exact"}) for w in d["wire"]
            )
            rec = cls(
                **{
                    **d,
                    "layer_types": tuple(d["layer_types"]),
                    "cuts": tuple(tuple(c) for c in d["cuts"]),
                    "wire": wire,
                    "prompts": tuple(d.get("prompts", ())),
                }
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"malformed capability record: {e}") from e
        if len(rec.model_sha256) != 64 or rec.state_kind not in STATE_KINDS:
            raise ModelError("malformed capability record: bad hash or state kind")
        if len(rec.layer_types) != rec.n_layers:
            raise ModelError("malformed capability record: layer types do not match layers")
        return rec

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
        if not isinstance(d, dict) or d.get(0) != RECORD_VERSION or len(d) != 4:
            raise ModelError("capability record is malformed or of an unsupported version")
        body, key, sig = d[1], d[2], d[3]
        if not all(isinstance(x, bytes) for x in (body, key, sig)):
            raise ModelError("capability record is malformed")
        try:
            VerifyKey(key).verify(_CONTEXT + body, sig)
        except (BadSignatureError, ValueError) as e:
            raise ModelError("capability record: bad signature (forged or tampered with)") from e
        try:
            record = CapabilityRecord.from_dict(cbor2.loads(body))
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"capability record body is not valid CBOR ({e})") from e
        if record.certifier != peer_id_for(key):
            raise ModelError("capability record names a certifier other than its signer")
        return cls(record, body, key, sig)


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
