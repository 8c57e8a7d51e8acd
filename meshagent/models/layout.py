"""What a GGUF model is made of: layers, exact bytes per layer, KV cost per token."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshagent.errors import ModelError
from meshagent.models.architectures import split_refusal, stage_refusal
from meshagent.models.gguf_file import TOKENIZER_PREFIX, GGUFFile
from meshagent.models.ranged import header_gaps

LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
KV_BYTES_F16 = 2

# llama.cpp loads no model without token embeddings, but the last stage of a split never looks
# a token up (its input is hidden states). Where the model has its own output head, the last
# stage's slice carries zeros in their place, in the smallest ggml type the width allows:
# (type name, weights per block, bytes per block), the first whose block divides the width.
STANDIN_TYPES = (("IQ1_S", 256, 50), ("Q4_0", 32, 18), ("F16", 1, 2))


def embedding_standin(n_embd: int) -> tuple[str, int, int]:
    """The ggml type of the zero embeddings a last stage carries, as `STANDIN_TYPES` lists."""
    return next(t for t in STANDIN_TYPES if n_embd % t[1] == 0)


def standin_bytes(n_vocab: int, n_embd: int, tied: bool) -> int:
    """What the zero embeddings of a last stage (not also the first) weigh: nothing where the
    output head is the embedding matrix itself (`tied`)."""
    if tied or not n_vocab or not n_embd:
        return 0
    _, per_block, block_bytes = embedding_standin(n_embd)
    return n_vocab * n_embd // per_block * block_bytes


@dataclass(frozen=True)
class ModelLayout:
    path: str
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int  # the most of any layer (a hybrid's state-space layers have none)
    head_dim: int
    context_length: int
    layer_bytes: tuple[int, ...]  # exact tensor bytes of each layer
    # Weights (elements) of each layer a token runs through: ~FLOPs/2 per token. With experts,
    # only the `expert_used_count` of `expert_count` the router picks (its memory is all of
    # them: `layer_bytes`).
    layer_params: tuple[int, ...]
    embedding_bytes: int  # token_embd
    head_bytes: int  # output_norm + output (or tied embeddings)
    other_bytes: int  # any other global tensor
    tied_embeddings: bool  # the output head is the token embedding matrix
    file_bytes: int
    split_refusal: str | None  # why the planner may not split it by default
    stage_refusal: str | None  # why the stage engine cannot run a slice of it at all
    layer_n_head_kv: tuple[int, ...]  # KV heads of each layer
    # Header bytes of its `tokenizer.*` entries: what a stage host fetches besides its tensors
    # when it carries the tokenizer (first and last stage) and read the header around them.
    tokenizer_bytes: int = 0
    # The ggml types of its weight matrices (`Q4_K`, `Q6_K`, ...): whether llama.cpp may
    # repack them (engine/runtime.py, `inexact_model`).
    weight_types: tuple[str, ...] = ()
    n_experts: int = 0  # experts of each MoE layer (0: a dense model)
    n_experts_used: int = 0  # of them, those each token is routed to
    # A sha256 of its tokens' list as the header spells it: two models with the same one
    # share a vocabulary, id for id (a draft model's tokens then go to it as they are). ""
    # where the list was not read (a partial copy's gap).
    vocab_sha256: str = ""

    @property
    def splittable(self) -> bool:
        return self.split_refusal is None

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """KV cache bytes one token costs in one layer, at f16."""
        return 2 * self.n_head_kv * self.head_dim * KV_BYTES_F16

    def weight_bytes(self, start: int, end: int) -> int:
        """Bytes of weights a stage over layers [start, end) holds: the first stage also holds
        the token embeddings, the last the output head (and, not also the first, the zero
        embeddings that stand in for the real ones: `standin_bytes`)."""
        total = sum(self.layer_bytes[start:end]) + self.other_bytes
        if start == 0:
            total += self.embedding_bytes
        if end == self.n_layers:
            total += self.head_bytes
            if start > 0:
                total += standin_bytes(self.n_vocab, self.n_embd, self.tied_embeddings)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "architecture": self.architecture,
            "name": self.name,
            "layers": self.n_layers,
            "n_embd": self.n_embd,
            "n_vocab": self.n_vocab,
            "context_length": self.context_length,
            "layer_bytes": list(self.layer_bytes),
            "embedding_bytes": self.embedding_bytes,
            "head_bytes": self.head_bytes,
            "other_bytes": self.other_bytes,
            "file_bytes": self.file_bytes,
            "tokenizer_bytes": self.tokenizer_bytes,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "experts": self.n_experts,
            "experts_used": self.n_experts_used,
            "layer_params": list(self.layer_params),
            "splittable": self.splittable,
            "split_refusal": self.split_refusal,
            "stage_refusal": self.stage_refusal,
        }


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF at `path`; a partial copy's header read around the entries not fetched."""
    if not path.is_file():
        raise ModelError(f"model file not found: {path}")
    try:
        return GGUFFile(path, header_gaps(path))
    except (ValueError, OSError, IndexError) as e:
        raise ModelError(f"{path} is not a readable GGUF file: {e}") from e


def inspect_model(path: Path) -> ModelLayout:
    r = open_gguf(path)
    arch = field(r, "general.architecture")
    if not arch:
        raise ModelError(f"{path} has no general.architecture: not a model GGUF")
    n_layers = int(field(r, f"{arch}.block_count", 0))
    n_embd = int(field(r, f"{arch}.embedding_length", 0))
    n_head = max(per_layer(field(r, f"{arch}.attention.head_count", 0), n_layers), default=0)
    # llama.cpp: head_count_kv defaults to head_count; a per-layer array of it marks a hybrid's
    # state-space layers with 0.
    head_kv = field(r, f"{arch}.attention.head_count_kv")
    layer_n_head_kv = per_layer(n_head if head_kv is None else head_kv, n_layers)
    n_head_kv = max(layer_n_head_kv, default=0)
    head_dim = int(field(r, f"{arch}.attention.key_length", 0) or (n_embd // max(n_head, 1)))
    layer_bytes = [0] * n_layers
    layer_params = [0] * n_layers
    n_experts = int(field(r, f"{arch}.expert_count", 0) or 0)
    n_used = int(field(r, f"{arch}.expert_used_count", 0) or 0)
    # A token runs through n_used of an experts tensor's n_experts slices.
    routed = n_used / n_experts if n_experts and 0 < n_used <= n_experts else 1.0
    embedding = head = other = 0
    n_vocab = 0
    for t in r.tensors:
        m = LAYER_TENSOR.match(t.name)
        if m:
            i = int(m.group(1))
            if i >= n_layers:
                raise ModelError(f"{path}: tensor {t.name} beyond block_count {n_layers}")
            layer_bytes[i] += int(t.n_bytes)
            share = routed if "_exps." in t.name else 1.0
            layer_params[i] += round(int(t.n_elements) * share)
        elif t.name == "token_embd.weight":
            embedding += int(t.n_bytes)
            n_vocab = int(t.shape[1])
        elif t.name in ("output.weight", "output_norm.weight"):
            head += int(t.n_bytes)
        else:
            other += int(t.n_bytes)
    tied = not any(t.name == "output.weight" for t in r.tensors)
    weight_types = sorted({t.tensor_type.name for t in r.tensors if len(t.shape) >= 2})
    if tied:
        head += embedding  # the last stage needs the embeddings as its output head
    shape = {"n_layers": n_layers, "n_embd": n_embd, "n_head": n_head, "head_dim": head_dim}
    return ModelLayout(
        path=str(path),
        architecture=arch,
        name=str(field(r, "general.name", path.stem)),
        n_layers=n_layers,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        context_length=int(field(r, f"{arch}.context_length", 0) or 0),
        layer_bytes=tuple(layer_bytes),
        layer_params=tuple(layer_params),
        embedding_bytes=embedding,
        head_bytes=head,
        other_bytes=other,
        tied_embeddings=tied,
        file_bytes=path.stat().st_size,
        split_refusal=split_refusal(arch, set(r.fields), **shape),
        stage_refusal=stage_refusal(arch, set(r.fields), **shape),
        layer_n_head_kv=layer_n_head_kv,
        tokenizer_bytes=_tokenizer_bytes(r),
        weight_types=tuple(weight_types),
        n_experts=n_experts,
        n_experts_used=n_used,
        vocab_sha256=_vocab_sha256(r),
    )


def _tokenizer_bytes(r: GGUFFile) -> int:
    """Header bytes of the `tokenizer.*` entries: read, or left out (a partial copy's gaps)."""
    spans = r.spans.items()
    return sum(b - a for k, (a, b) in spans if k.startswith(TOKENIZER_PREFIX)) + sum(
        b - a for a, b, _ in r.gaps
    )


VOCAB_KEY = "tokenizer.ggml.tokens"


def _vocab_sha256(r: GGUFFile) -> str:
    """The sha256 of the header entry that lists the tokens (its key, type and strings)."""
    span = r.spans.get(VOCAB_KEY)
    if span is None:
        return ""
    start, end = span
    return hashlib.sha256(r.data[start:end]).hexdigest()


def per_layer(value: Any, n_layers: int) -> tuple[int, ...]:
    """A hyperparameter llama.cpp reads as one number for every layer or an array of them."""
    if isinstance(value, list):
        if len(value) != n_layers:
            raise ModelError(f"a per-layer array of {len(value)} values for {n_layers} layers")
        return tuple(int(v) for v in value)
    return (int(value or 0),) * n_layers
