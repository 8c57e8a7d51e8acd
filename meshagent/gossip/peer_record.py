"""PeerRecord: what one agent tells the mesh about itself (capacity, addresses, holdings).

A record is owned and signed by the peer it describes (see `signed.py`); this module only
defines its fields and their CBOR form. Every field is validated at decode, with bounds, so
a record that passes `from_body` is safe to hand to placement code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import cbor2

from meshagent.gossip.errors import RecordRejected
from meshagent.net.coordinates import Coordinate
from meshagent.wire.quoted import quoted

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024  # encoded body; an owner refuses to publish a larger one
MAX_ADDRESSES = 16
MAX_RTTS = 256
MAX_MODELS = 32
MAX_ARTIFACTS = 128
MAX_SERVING = 32
MAX_EXTRAS = 32
MAX_CAPABILITIES = 8
MAX_CAPABILITY_BYTES = 8 * 1024
MAX_DEVICES = 16
MAX_CATALOG = 32  # catalogue entries (`catalog/book.py`, MAX_GOSSIPED)
MAX_CATALOG_BYTES = 1024  # one entry, encoded (`catalog/entry.py`, MAX_ENTRY_BYTES)
MAX_TEXT = 255
MAX_DRAFT_GFLOPS = 10_000.0  # a draft model's GFLOP per token (a 5-trillion-parameter one)


@dataclass(frozen=True)
class ModelHeld:
    """A whole model file this peer has locally."""

    id: str
    sha256: str  # of the GGUF file; "" if not hashed (yet)
    architecture: str
    n_layers: int
    size_bytes: int

    def to_wire(self) -> list[Any]:
        return [self.id, self.sha256, self.architecture, self.n_layers, self.size_bytes]

    @classmethod
    def from_wire(cls, v: Any) -> ModelHeld:
        a = _list(v, 5, "model")
        return cls(_text(a[0]), _hash_or_empty(a[1]), _text(a[2]), _uint(a[3]), _uint(a[4]))


@dataclass(frozen=True)
class ArtifactHeld:
    """A stage artifact in this peer's cache (a `SliceManifest`, trimmed to what placement
    and fetching need)."""

    key: str
    sha256: str
    kind: str  # "layers" or "entry"
    source_sha256: str
    source_name: str
    start: int
    end: int
    total_layers: int
    size_bytes: int
    weight_bytes: int
    kv_bytes_per_token_per_layer: int

    @classmethod
    def from_manifest(cls, m: Any) -> ArtifactHeld:
        return cls(
            key=m.key,
            sha256=m.sha256,
            kind=m.kind,
            source_sha256=m.source_sha256,
            source_name=m.source_name,
            start=m.start,
            end=m.end,
            total_layers=m.total_layers,
            size_bytes=m.size_bytes,
            weight_bytes=m.weight_bytes,
            kv_bytes_per_token_per_layer=m.kv_bytes_per_token_per_layer,
        )

    def to_wire(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_wire(cls, v: Any) -> ArtifactHeld:
        a = _list(v, 11, "artifact")
        out = cls(
            _text(a[0]),
            _hash(a[1]),
            _text(a[2]),
            _hash(a[3]),
            _text(a[4]),
            *(_uint(x) for x in a[5:]),
        )
        if not out.start <= out.end <= out.total_layers:
            raise RecordRejected(f"artifact {out.key!r} has a bad layer range")
        return out


@dataclass(frozen=True)
class Serving:
    """Layers [start, end) of a model this peer serves now (the whole model: 0..total)."""

    model: str
    sha256: str  # of the source model; "" if unknown
    start: int
    end: int
    total_layers: int

    def to_wire(self) -> list[Any]:
        return [self.model, self.sha256, self.start, self.end, self.total_layers]

    @classmethod
    def from_wire(cls, v: Any) -> Serving:
        a = _list(v, 5, "serving entry")
        out = cls(_text(a[0]), _hash_or_empty(a[1]), _uint(a[2]), _uint(a[3]), _uint(a[4]))
        if not out.start <= out.end <= out.total_layers:
            raise RecordRejected(f"serving entry {out.model!r} has a bad layer range")
        return out


@dataclass(frozen=True)
class DeviceOffer:
    """A device (GPU) this peer's llama.cpp can offload layers to: its memory, what of it the
    peer offers the mesh (`--max-vram`), and its speed in the unit of `compute_speed`."""

    name: str  # ggml's, e.g. "CUDA0"
    description: str  # e.g. "NVIDIA H200"
    kind: str  # "gpu" or "igpu"
    total_bytes: int
    free_bytes: int
    offer_bytes: int
    speed: float  # 0 until measured

    def to_wire(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_wire(cls, v: Any) -> DeviceOffer:
        a = _list(v, 7, "device")
        return cls(
            _text(a[0]),
            _text(a[1]),
            _text(a[2]),
            _uint(a[3]),
            _uint(a[4]),
            _uint(a[5]),
            _float(a[6]),
        )


@dataclass(frozen=True)
class PeerRecord:
    """One peer's self-description. `seq` orders the owner's records: a higher seq replaces
    a lower one everywhere; the owner derives it from its wall clock (microseconds) so it
    keeps growing across restarts without stored state."""

    peer_id: str
    public_key: bytes
    seq: int
    issued_at: float = 0.0  # owner's wall clock, informational only
    name: str = ""
    agent_version: str = ""
    addresses: tuple[str, ...] = ()  # overlay addresses to dial, host:port
    relays: tuple[str, ...] = ()  # relays this peer is registered with
    mem_weights_bytes: int = 0  # memory available for model weights
    mem_kv_bytes: int = 0  # memory available for KV cache
    # memory beyond those two, where llama.cpp's compute buffers go first (0: none; they
    # then come out of the offer)
    mem_spare_bytes: int = 0
    compute_speed: float = 0.0
    compute_unit: str = ""  # what compute_speed measures, e.g. "matmul_gflops_f32"
    rtts_ms: tuple[tuple[str, float], ...] = ()  # (peer id, smoothed overlay RTT in ms)
    models: tuple[ModelHeld, ...] = ()
    artifacts: tuple[ArtifactHeld, ...] = ()
    serving: tuple[Serving, ...] = ()
    # Signed capability records of models this peer holds (`models/capability.py`), opaque
    # here: whoever uses one verifies its signature.
    capabilities: tuple[bytes, ...] = ()
    # Why this peer's llama.cpp computes a draft's window otherwise than one-token steps
    # (engine/windows.py); "" where it computes them alike. A split's entry drafts by default
    # only where every stage's engine does.
    windows_inexact: str = ""
    # Devices besides the CPU (GPUs) and what of their memory is offered; none on a CPU agent.
    devices: tuple[DeviceOffer, ...] = ()
    # The sha256 of each model file whose header this peer read without the tokenizer (a
    # stage host's partial copy): it downloads the tokenizer before a first or last stage.
    no_tokenizer: tuple[str, ...] = ()
    # Signed entries of the mesh's catalogue of models (`catalog/entry.py`) as this peer
    # knows it, opaque here: whoever uses one verifies its signature.
    catalog: tuple[bytes, ...] = ()
    # What stands between this peer and the internet (`discovery/nat.py`: none, independent,
    # dependent, unknown), as its relays see it; "" where it has no relay to ask.
    nat: str = ""
    # Its network coordinate (`net/coordinates.py`): x, y and height in ms, and its error;
    # () until it has one. Placement estimates the RTT between peers that never measured it.
    coord: tuple[float, ...] = ()
    # The draft model it runs as a model's entry (`--draft-model`): GFLOP per token, and the
    # smallest model (GFLOP per token) it drafts for; (0, 0) without one. Placement counts
    # its compute at the entry.
    draft_gflops: tuple[float, float] = (0.0, 0.0)
    # Fields other services publish without a record format change (e.g. placement
    # leases): text keys, CBOR values.
    extras: dict[str, Any] = field(default_factory=dict)
    version: int = RECORD_VERSION

    def rtt_to(self, peer_id: str) -> float | None:
        return dict(self.rtts_ms).get(peer_id)

    def to_body(self) -> bytes:
        wire: dict[int, Any] = {
            0: self.version,
            1: self.peer_id,
            2: self.public_key,
            3: self.seq,
            4: float(self.issued_at),
            5: self.name,
            6: self.agent_version,
            7: list(self.addresses),
            8: list(self.relays),
            9: self.mem_weights_bytes,
            10: self.mem_kv_bytes,
            11: float(self.compute_speed),
            12: self.compute_unit,
            13: [[p, float(ms)] for p, ms in self.rtts_ms],
            14: [m.to_wire() for m in self.models],
            15: [a.to_wire() for a in self.artifacts],
            16: [s.to_wire() for s in self.serving],
            17: dict(self.extras),
        }
        if self.capabilities:  # absent when empty: records without any keep their bytes
            wire[18] = list(self.capabilities)
        if self.windows_inexact:  # likewise
            wire[19] = self.windows_inexact
        if self.devices:  # likewise
            wire[20] = [d.to_wire() for d in self.devices]
        if self.mem_spare_bytes:  # likewise
            wire[21] = self.mem_spare_bytes
        if self.no_tokenizer:  # likewise
            wire[22] = list(self.no_tokenizer)
        if self.catalog:  # likewise
            wire[23] = list(self.catalog)
        if self.nat:  # likewise
            wire[24] = self.nat
        if self.coord:  # likewise
            wire[25] = [float(f) for f in self.coord]
        if self.draft_gflops[0]:  # likewise
            wire[26] = [float(f) for f in self.draft_gflops]
        body = cbor2.dumps(wire, canonical=True)
        if len(body) > MAX_RECORD_BYTES:
            raise RecordRejected(
                f"record of {len(body)} bytes is over the {MAX_RECORD_BYTES}-byte limit; "
                "publish fewer artifacts or smaller extras"
            )
        return body

    @classmethod
    def from_body(cls, body: bytes) -> PeerRecord:
        if len(body) > MAX_RECORD_BYTES:
            raise RecordRejected(f"record of {len(body)} bytes is over the limit")
        try:
            d = cbor2.loads(body)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise RecordRejected(f"record is not valid CBOR ({e})") from e
        if not isinstance(d, dict) or type(d.get(0)) is not int or d[0] != RECORD_VERSION:
            raise RecordRejected("record is malformed or of an unsupported version")
        try:
            pk = d[2]
            if not isinstance(pk, bytes) or len(pk) != 32:
                raise RecordRejected("record public key must be 32 bytes")
            extras = d.get(17, {})
            if not isinstance(extras, dict) or len(extras) > MAX_EXTRAS:
                raise RecordRejected("record extras must be a small map")
            for k in extras:
                _text(k)
            return cls(
                peer_id=_text(d[1]),
                public_key=pk,
                seq=_uint(d[3]),
                issued_at=_float(d.get(4, 0.0)),
                name=_text(d.get(5, "")),
                agent_version=_text(d.get(6, "")),
                addresses=tuple(_text(a) for a in _bounded(d.get(7, []), MAX_ADDRESSES)),
                relays=tuple(_text(a) for a in _bounded(d.get(8, []), MAX_ADDRESSES)),
                mem_weights_bytes=_uint(d.get(9, 0)),
                mem_kv_bytes=_uint(d.get(10, 0)),
                compute_speed=_float(d.get(11, 0.0)),
                compute_unit=_text(d.get(12, "")),
                rtts_ms=tuple(
                    (_text(_list(r, 2, "rtt")[0]), _float(r[1]))
                    for r in _bounded(d.get(13, []), MAX_RTTS)
                ),
                models=tuple(ModelHeld.from_wire(m) for m in _bounded(d.get(14, []), MAX_MODELS)),
                artifacts=tuple(
                    ArtifactHeld.from_wire(a) for a in _bounded(d.get(15, []), MAX_ARTIFACTS)
                ),
                serving=tuple(Serving.from_wire(s) for s in _bounded(d.get(16, []), MAX_SERVING)),
                extras=dict(extras),
                capabilities=tuple(
                    _blob(c, MAX_CAPABILITY_BYTES)
                    for c in _bounded(d.get(18, []), MAX_CAPABILITIES)
                ),
                windows_inexact=_text(d.get(19, "")),
                devices=tuple(
                    DeviceOffer.from_wire(x) for x in _bounded(d.get(20, []), MAX_DEVICES)
                ),
                mem_spare_bytes=_uint(d.get(21, 0)),
                no_tokenizer=tuple(_text(x) for x in _bounded(d.get(22, []), MAX_MODELS)),
                catalog=tuple(
                    _blob(c, MAX_CATALOG_BYTES) for c in _bounded(d.get(23, []), MAX_CATALOG)
                ),
                nat=_nat(d.get(24, "")),
                coord=_coord(d.get(25)),
                draft_gflops=_draft(d.get(26)),
            )
        except KeyError as e:
            raise RecordRejected(f"record lacks field {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (for the control API)."""
        return {
            "peer_id": self.peer_id,
            "seq": self.seq,
            "issued_at": self.issued_at,
            "name": self.name,
            "agent_version": self.agent_version,
            "addresses": list(self.addresses),
            "relays": list(self.relays),
            "mem_weights_bytes": self.mem_weights_bytes,
            "mem_kv_bytes": self.mem_kv_bytes,
            "mem_spare_bytes": self.mem_spare_bytes,
            "no_tokenizer": list(self.no_tokenizer),
            "compute_speed": self.compute_speed,
            "compute_unit": self.compute_unit,
            "rtts_ms": dict(self.rtts_ms),
            "models": [m.__dict__ for m in self.models],
            "artifacts": [a.__dict__ for a in self.artifacts],
            "serving": [s.__dict__ for s in self.serving],
            "extras": {k: _jsonable(v) for k, v in self.extras.items()},
            "capabilities": len(self.capabilities),
            "catalog": len(self.catalog),
            "windows_inexact": self.windows_inexact,
            "devices": [d.__dict__ for d in self.devices],
            "nat": self.nat,
            "coord": list(self.coord),
            "draft_gflops": list(self.draft_gflops),
        }


# Fields an owner may set with `update_local`; identity and ordering fields are not among them.
PUBLISHABLE = frozenset(
    f.name
    for f in fields(PeerRecord)
    if f.name not in ("peer_id", "public_key", "seq", "issued_at", "version")
)


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise RecordRejected(f"expected text of at most {MAX_TEXT} characters, got {quoted(v, 60)}")
    return v


NAT_KINDS = ("", "none", "independent", "dependent", "unknown")  # discovery/nat.py's


def _nat(v: Any) -> str:
    if v not in NAT_KINDS or not isinstance(v, str):
        raise RecordRejected(f"nat must be one of {', '.join(NAT_KINDS[1:])}, not {quoted(v, 40)}")
    return v


def _hash(v: Any) -> str:
    if not isinstance(v, str) or len(v) != 64:
        raise RecordRejected(f"expected a sha256 hex digest, got {quoted(v, 80)}")
    return v


def _hash_or_empty(v: Any) -> str:
    return "" if v == "" else _hash(v)


def _blob(v: Any, limit: int) -> bytes:
    if not isinstance(v, bytes) or len(v) > limit:
        raise RecordRejected(f"expected bytes of at most {limit}, got {type(v).__name__}")
    return v


def _uint(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
        raise RecordRejected(f"expected an unsigned 64-bit integer, got {quoted(v)}")
    return v


def _float(v: Any) -> float:
    # (An integer is taken where a float holds it: `float()` overflows past 1.8e308.)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**1023:
        return float(v)
    if type(v) is not float or not math.isfinite(v) or v < 0:
        raise RecordRejected(f"expected a finite non-negative number, got {quoted(v)}")
    return v


def _list(v: Any, n: int, what: str) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise RecordRejected(f"{what} must be a list of {n} items")
    return v


def _coord(v: Any) -> tuple[float, ...]:
    if v is None:
        return ()
    c = Coordinate.from_wire(v)
    if c is None:
        raise RecordRejected(
            f"coord must be [x, y, height, error], finite and in bounds, not {quoted(v, 60)}"
        )
    return (c.x, c.y, c.height, c.error)


def _draft(v: Any) -> tuple[float, float]:
    if v is None:
        return (0.0, 0.0)
    gflops, above = (_float(x) for x in _list(v, 2, "draft_gflops"))
    if not 0 < gflops <= MAX_DRAFT_GFLOPS:
        raise RecordRejected(
            f"draft_gflops must be [GFLOP per token, over 0 and at most {MAX_DRAFT_GFLOPS:g}; "
            f"the smallest model it drafts for], not {quoted(v, 60)}"
        )
    return (gflops, above)


def _bounded(v: Any, limit: int) -> list[Any]:
    if not isinstance(v, list) or len(v) > limit:
        raise RecordRejected(f"expected a list of at most {limit} items")
    return v
