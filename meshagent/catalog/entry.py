"""Catalogue entries: one signed operation on one name of the mesh's catalogue of models.

An entry adds a model under a name (the id the API serves it as) or removes the name (a
tombstone). An add says where the model comes from (a hub name, or a path on the machine of
the agent that added it), the sha256 and size of its file and its layout as placement needs
it (`ModelCost`, the bytes of its layers run-length encoded so that an 80-layer model's entry
stays well under `MAX_ENTRY_BYTES`). `version` is a Lamport counter per name: a new operation
on a name takes the highest version known for it plus one (`book.py` merges).

On disk and on the wire an entry is CBOR `{0: format version, 1: body, 2: public key,
3: signature}`; the signature covers `_CONTEXT` and the body, and the body is the entry's own
CBOR (a map with small integer keys, `_KEYS`). Decoding verifies: an entry that decodes is
the one its author wrote, and every field of its body was checked once against its range; a
bad entry raises CatalogError naming the field, never anything else.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import cbor2
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from meshagent.errors import CatalogError
from meshagent.gossip.peer_record import MAX_CATALOG_BYTES
from meshagent.identity.keys import NodeIdentity, peer_id_for
from meshagent.models.layout import ModelLayout
from meshagent.placement.planner import ModelCost
from meshagent.wire.quoted import quoted

FORMAT_VERSION = 1
MAX_ENTRY_BYTES = MAX_CATALOG_BYTES  # a signed entry, encoded
_CONTEXT = b"meshagent/catalog-entry/v1\x00"
ADD = "add"
REMOVE = "remove"
OPS = (ADD, REMOVE)

# The ranges of what an entry holds.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")  # the ids `model_id_for` gives files
VERSIONS = range(1, 2**32)
TIMES = range(0, 2**40)  # unix seconds
SIZES = range(1, 2**53)  # the model file's bytes
BYTES = range(0, 2**53)  # a part of it
LAYERS = range(1, 1 << 16)
KV_BYTES = range(0, 2**32)  # per token per layer
N_EMBD = range(0, 1 << 20)
N_VOCAB = range(0, 1 << 24)
MAX_FLOPS = 1e18  # per token per layer
MAX_SOURCE = 255
MAX_ARCHITECTURE = 64
MAX_REFUSAL = 255
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Body keys. An add carries them all (`split_refusal` only when the model may not split);
# a remove only the first four.
_KEYS = {
    "name": 1,
    "op": 2,
    "version": 3,
    "time": 4,
    "source": 5,
    "sha256": 6,
    "size": 7,
    "architecture": 8,
    "n_layers": 9,
    "layer_bytes": 10,  # [[bytes, count], ...]: `count` layers in a row of `bytes` each
    "embedding_bytes": 11,
    "head_bytes": 12,
    "other_bytes": 13,
    "kv_bytes_per_token_per_layer": 14,
    "flops_per_layer": 15,
    "tied_embeddings": 16,
    "split_refusal": 17,
    "n_embd": 18,
    "n_vocab": 19,
    "tokenizer_bytes": 20,
    "vocab_sha256": 21,
}
_NAMES = {k: name for name, k in _KEYS.items()}
_REMOVE_KEYS = frozenset(_KEYS[n] for n in ("name", "op", "version", "time"))
_ADD_KEYS = frozenset(_KEYS.values())
_OPTIONAL = frozenset({_KEYS["split_refusal"], _KEYS["vocab_sha256"]})
# An add's fields that go on the wire as they are.
_ENCODED = ("layer_bytes", "flops_per_layer", "split_refusal", "vocab_sha256")
_ADD_FIELDS = tuple(n for n in _KEYS if _KEYS[n] > 4 and n not in _ENCODED)


@dataclass(frozen=True)
class CatalogEntry:
    """One operation on a name; the model's fields are set for an add only (their defaults
    on a remove)."""

    name: str
    op: str
    version: int  # Lamport counter of this name
    time: int  # unix seconds when signed: informative, and when a tombstone expires
    source: str = ""  # what `resolve_model` takes: a hub name, a path, "" the embedded default
    sha256: str = ""  # of the model file
    size: int = 0  # of the model file, in bytes
    architecture: str = ""
    n_layers: int = 0
    layer_bytes: tuple[int, ...] = ()
    embedding_bytes: int = 0
    head_bytes: int = 0
    other_bytes: int = 0
    kv_bytes_per_token_per_layer: int = 0
    flops_per_layer: float = 0.0
    tied_embeddings: bool = False
    split_refusal: str | None = None
    n_embd: int = 0
    n_vocab: int = 0
    tokenizer_bytes: int = 0
    # Its tokens' list, hashed (`ModelLayout.vocab_sha256`): which models can draft for it
    # token for token (`--draft-model auto`); "" where its author's agent did not read it.
    vocab_sha256: str = ""

    @classmethod
    def add(
        cls,
        name: str,
        source: str,
        sha256: str,
        size: int,
        layout: ModelLayout,
        *,
        version: int,
        time: int,
    ) -> CatalogEntry:
        """An add of the model file `layout` describes, hashed to `sha256`, of `size` bytes."""
        cost = ModelCost.from_layout(name, layout)
        return cls(
            name=name,
            op=ADD,
            version=version,
            time=time,
            source=source,
            sha256=sha256,
            size=size,
            architecture=layout.architecture,
            n_layers=cost.n_layers,
            layer_bytes=tuple(cost.layer_bytes),
            embedding_bytes=cost.embedding_bytes,
            head_bytes=cost.head_bytes,
            other_bytes=cost.other_bytes,
            kv_bytes_per_token_per_layer=cost.kv_bytes_per_token_per_layer,
            flops_per_layer=cost.flops_per_layer,
            tied_embeddings=cost.tied_embeddings,
            split_refusal=cost.split_refusal,
            n_embd=cost.n_embd,
            n_vocab=cost.n_vocab,
            tokenizer_bytes=cost.tokenizer_bytes,
            vocab_sha256=layout.vocab_sha256,
        )

    @classmethod
    def remove(cls, name: str, *, version: int, time: int) -> CatalogEntry:
        """A tombstone for `name`."""
        return cls(name=name, op=REMOVE, version=version, time=time)

    @property
    def is_add(self) -> bool:
        return self.op == ADD

    def cost(self) -> ModelCost:
        """What the model costs to host, for placement; CatalogError for a tombstone."""
        if not self.is_add:
            raise CatalogError(f"the catalogue entry for {self.name} removes it: no model")
        return ModelCost(
            model_id=self.name,
            n_layers=self.n_layers,
            layer_bytes=self.layer_bytes,
            embedding_bytes=self.embedding_bytes,
            head_bytes=self.head_bytes,
            other_bytes=self.other_bytes,
            kv_bytes_per_token_per_layer=self.kv_bytes_per_token_per_layer,
            flops_per_layer=self.flops_per_layer,
            tied_embeddings=self.tied_embeddings,
            split_refusal=self.split_refusal,
            n_embd=self.n_embd,
            n_vocab=self.n_vocab,
            tokenizer_bytes=self.tokenizer_bytes,
        )

    def to_wire(self) -> dict[int, Any]:
        """The body's CBOR map."""
        out: dict[int, Any] = {1: self.name, 2: self.op, 3: self.version, 4: self.time}
        if not self.is_add:
            return out
        for name in _ADD_FIELDS:
            out[_KEYS[name]] = getattr(self, name)
        out[_KEYS["flops_per_layer"]] = float(self.flops_per_layer)
        out[_KEYS["layer_bytes"]] = [list(run) for run in _runs(self.layer_bytes)]
        if self.split_refusal is not None:
            out[_KEYS["split_refusal"]] = self.split_refusal
        if self.vocab_sha256:
            out[_KEYS["vocab_sha256"]] = self.vocab_sha256
        return out

    @classmethod
    def from_wire(cls, d: Any) -> CatalogEntry:
        """The entry a body holds; CatalogError naming the first field out of its range."""
        if not isinstance(d, dict):
            raise CatalogError(f"a catalogue entry's body is a map, not {quoted(d)}")
        op = _value(d, "op")
        if op not in OPS:
            raise CatalogError(f"catalogue entry field 'op' is {quoted(op)}, not one of {OPS}")
        expected = _ADD_KEYS if op == ADD else _REMOVE_KEYS
        for k in d:
            if k not in expected:
                raise CatalogError(
                    f"a catalogue entry that does {op!r} has no field {quoted(_NAMES.get(k, k))}"
                )
        name = _value(d, "name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise CatalogError(
                f"catalogue entry field 'name' is {quoted(name)}, not a model name (letters, "
                "digits, '.', '_', '+' and '-', at most 128, beginning with a letter or digit)"
            )
        head = {
            "name": name,
            "op": op,
            "version": _int(d, "version", VERSIONS),
            "time": _int(d, "time", TIMES),
        }
        if op == REMOVE:
            return cls(**head)
        missing = [_NAMES[k] for k in sorted(_ADD_KEYS - _OPTIONAL - set(d))]
        if missing:
            raise CatalogError(f"catalogue entry lacks field {missing[0]!r}")
        n_layers = _int(d, "n_layers", LAYERS)
        sha = _value(d, "sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise CatalogError(
                f"catalogue entry field 'sha256' is {quoted(sha)}, not a sha256 in hex"
            )
        flops = _value(d, "flops_per_layer")
        if type(flops) is int and 0 <= flops <= MAX_FLOPS:
            flops = float(flops)
        if type(flops) is not float or not 0.0 <= flops <= MAX_FLOPS:  # NaN too
            raise CatalogError(
                f"catalogue entry field 'flops_per_layer' is {quoted(flops)}, not a number "
                f"of 0-{MAX_FLOPS:g}"
            )
        tied = _value(d, "tied_embeddings")
        if type(tied) is not bool:
            raise CatalogError(
                f"catalogue entry field 'tied_embeddings' is {quoted(tied)}, not true or false"
            )
        refusal = d.get(_KEYS["split_refusal"])
        if refusal is not None:
            refusal = _text(d, "split_refusal", MAX_REFUSAL, empty=False)
        vocab = d.get(_KEYS["vocab_sha256"], "")
        if vocab != "" and (not isinstance(vocab, str) or not _SHA256.fullmatch(vocab)):
            raise CatalogError(
                f"catalogue entry field 'vocab_sha256' is {quoted(vocab)}, not a sha256 in hex"
            )
        return cls(
            **head,
            source=_text(d, "source", MAX_SOURCE),
            sha256=sha,
            size=_int(d, "size", SIZES),
            architecture=_text(d, "architecture", MAX_ARCHITECTURE),
            n_layers=n_layers,
            layer_bytes=_layer_bytes(_value(d, "layer_bytes"), n_layers),
            embedding_bytes=_int(d, "embedding_bytes", BYTES),
            head_bytes=_int(d, "head_bytes", BYTES),
            other_bytes=_int(d, "other_bytes", BYTES),
            kv_bytes_per_token_per_layer=_int(d, "kv_bytes_per_token_per_layer", KV_BYTES),
            flops_per_layer=flops,
            tied_embeddings=tied,
            split_refusal=refusal,
            n_embd=_int(d, "n_embd", N_EMBD),
            n_vocab=_int(d, "n_vocab", N_VOCAB),
            tokenizer_bytes=_int(d, "tokenizer_bytes", BYTES),
            vocab_sha256=vocab,
        )

    def sign(self, identity: NodeIdentity) -> SignedEntry:
        """This entry signed by `identity`, its author. CatalogError if a peer would refuse
        it: a field out of range, or over `MAX_ENTRY_BYTES` encoded."""
        body = cbor2.dumps(self.to_wire(), canonical=True)
        checked = CatalogEntry.from_wire(cbor2.loads(body))
        if checked != self:
            raise CatalogError(f"the catalogue entry for {self.name} does not survive encoding")
        signed = SignedEntry(
            self, body, identity.public_key, identity.sign(_CONTEXT + body), identity.peer_id
        )
        size = len(signed.to_bytes())
        if size > MAX_ENTRY_BYTES:
            raise CatalogError(
                f"the catalogue entry for {self.name} is {size} bytes, over the "
                f"{MAX_ENTRY_BYTES}-byte limit (a long source path, or too many layer sizes)"
            )
        return signed


@dataclass(frozen=True)
class SignedEntry:
    """An entry as its author signed it; `author` is the signer's peer id."""

    entry: CatalogEntry
    body: bytes
    public_key: bytes
    signature: bytes
    author: str

    def to_bytes(self) -> bytes:
        return cbor2.dumps({0: FORMAT_VERSION, 1: self.body, 2: self.public_key, 3: self.signature})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (the control API's): who did what to the name, and when;
        for an add, what the model is."""
        e = self.entry
        out: dict[str, Any] = {"name": e.name, "op": e.op, "version": e.version}
        out["author"] = self.author
        if not e.is_add:
            return {**out, "removed_at": e.time}
        return {
            **out,
            "added_at": e.time,
            "source": e.source,
            "sha256": e.sha256,
            "size": e.size,
            "architecture": e.architecture,
            "layers": e.n_layers,
            "splittable": e.split_refusal is None,
        }

    @property
    def rank(self) -> tuple[int, str, bytes]:
        """How operations on one name are ordered: the highest rank wins. The Lamport
        version first, then the author's peer id; the bytes last, so that even two entries
        an author signed alike are ordered the same everywhere."""
        return (self.entry.version, self.author, self.to_bytes())

    @classmethod
    def from_bytes(cls, data: Any) -> SignedEntry:
        """Decode and verify; CatalogError for anything malformed, forged or tampered with."""
        if not isinstance(data, bytes):
            raise CatalogError(f"a catalogue entry is bytes, not {type(data).__name__}")
        if len(data) > MAX_ENTRY_BYTES:
            raise CatalogError(f"a catalogue entry of {len(data)} bytes is over the limit")
        try:
            d = cbor2.loads(data)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise CatalogError(f"a catalogue entry is not valid CBOR ({e})") from e
        if not isinstance(d, dict) or set(d) != {0, 1, 2, 3}:
            raise CatalogError(f"a catalogue entry is malformed: {quoted(d)}")
        if type(d[0]) is not int or d[0] != FORMAT_VERSION:  # True and 1.0 equal 1
            raise CatalogError(f"a catalogue entry of format {quoted(d[0])}, not {FORMAT_VERSION}")
        body, key, sig = d[1], d[2], d[3]
        if not all(isinstance(x, bytes) for x in (body, key, sig)):
            raise CatalogError("a catalogue entry's body, key and signature are bytes")
        try:
            VerifyKey(key).verify(_CONTEXT + body, sig)
        except (BadSignatureError, ValueError, TypeError) as e:
            raise CatalogError("a catalogue entry's signature is bad (forged or altered)") from e
        try:
            fields_ = cbor2.loads(body)
        except Exception as e:  # cbor2 raises several unrelated types on garbage
            raise CatalogError(f"a catalogue entry's body is not valid CBOR ({e})") from e
        entry = CatalogEntry.from_wire(fields_)
        return cls(entry, body, key, sig, peer_id_for(key))


def _runs(values: tuple[int, ...]) -> list[tuple[int, int]]:
    """Run-length encoding: (value, how many in a row)."""
    return [(v, len(list(group))) for v, group in itertools.groupby(values)]


def _layer_bytes(v: Any, n_layers: int) -> tuple[int, ...]:
    """Each layer's bytes from its runs: `[bytes, count]` pairs whose counts add up to
    `n_layers`."""
    if not isinstance(v, list) or not 0 < len(v) <= n_layers:
        shown = f"{len(v)} runs" if isinstance(v, list) else quoted(v)
        raise CatalogError(
            f"catalogue entry field 'layer_bytes' is {shown}, not 1-{n_layers} runs of "
            "[bytes, count]"
        )
    out: list[int] = []
    for run in v:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or type(run[0]) is not int
            or run[0] not in BYTES
            or type(run[1]) is not int
            or run[1] not in LAYERS
        ):
            raise CatalogError(
                f"catalogue entry field 'layer_bytes' holds {quoted(run)}, not [bytes, count] "
                f"with bytes of {BYTES.start}-{BYTES.stop - 1} and count of 1-{n_layers}"
            )
        if len(out) + run[1] > n_layers:
            break
        out += [run[0]] * run[1]
    if len(out) != n_layers or sum(run[1] for run in v) != n_layers:
        raise CatalogError(
            f"catalogue entry field 'layer_bytes' does not count the {n_layers} layers of "
            "field 'n_layers'"
        )
    return tuple(out)


def _value(d: dict[Any, Any], name: str) -> Any:
    key = _KEYS[name]
    if key not in d:
        raise CatalogError(f"catalogue entry lacks field {name!r}")
    return d[key]


def _int(d: dict[Any, Any], name: str, allowed: range) -> int:
    v = _value(d, name)
    if type(v) is not int or v not in allowed:
        raise CatalogError(
            f"catalogue entry field {name!r} is {quoted(v)}, not an integer of "
            f"{allowed.start}-{allowed.stop - 1}"
        )
    return v


def _text(d: dict[Any, Any], name: str, most: int, *, empty: bool = True) -> str:
    v = _value(d, name)
    if not isinstance(v, str) or len(v) > most or (not v and not empty) or not v.isprintable():
        raise CatalogError(
            f"catalogue entry field {name!r} is {quoted(v)}, not printable text of "
            f"{0 if empty else 1}-{most} characters"
        )
    return v
