"""Cutting a GGUF model into stage artifacts that llama.cpp loads as models of their own.

A `layers` artifact holds layers [a, b) renumbered from 0. Unless it ends the model it carries a
placeholder vocabulary of a few tokens, so its output head costs nothing (its output is the
residual stream, read by the engine's capture hook). An `entry` artifact holds what the first
stage needs besides its layers: the tokenizer, the chat template and the token embeddings.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType

from meshagent.errors import ModelError, OutOfRange
from meshagent.models.architectures import INPUT_SCALED_FOR_TOKENS, SWA_PATTERN
from meshagent.models.family import ATTENTION, RECURRENT, family_traits
from meshagent.models.gguf_file import TOKENIZER_PREFIX, GGUFFile
from meshagent.models.layout import LAYER_TENSOR, ModelLayout, embedding_standin, open_gguf
from meshagent.wording import layer_range

PLACEHOLDER_VOCAB = 8
SLICE_KEY_PREFIX = "meshagent.slice."
PAD_LAYERS_KEY = "pad_layers"
# Hyperparameters llama.cpp reads as one value or an array of one per layer (get_key_or_arr with
# n_layer): as arrays they are cut with the layers. Jamba's head_count_kv array is its layer
# pattern (0 marks a Mamba layer). The experts' width is read so by the MoE families (gpt-oss
# among them).
PER_LAYER_KEYS = (
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "expert_feed_forward_length",
)

# Hyperparameters that name layers by absolute index, rewritten for each slice: the count of
# leading dense layers (DeepSeek-V2/V3 and kin: the layers before it have a dense FFN, those
# from it on experts) becomes the count of the slice's leading layers that are dense.
LEADING_DENSE_KEY = "leading_dense_block_count"

# Which layers use the sliding window, for the families that choose them by index
# (`architectures.SWA_PATTERN`): one number n (layer i is windowed when i % n < n - 1) or one
# flag per layer. A slice gets its layers' flags.
SWA_PATTERN_KEY = "attention.sliding_window_pattern"

Progress = Callable[[int, int], None]


def _copy_metadata(
    reader: GGUFFile,
    writer: gguf.GGUFWriter,
    *,
    skip: Callable[[str], bool],
    layers: Sequence[int] = (),
    per_layer: frozenset[str] = frozenset(),
) -> None:
    """Copy every metadata key but the skipped ones; an array named in `per_layer` becomes its
    values at `layers` (the source layer of each layer of the slice)."""
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or skip(key):
            continue
        vtype = f.types[0]
        if vtype == GGUFValueType.ARRAY:
            value = f.contents()
            if key in per_layer:
                value = [value[i] for i in layers]
            writer.add_key_value(key, value, vtype, sub_type=f.types[-1])
        else:
            writer.add_key_value(key, f.contents(), vtype)


def _per_layer_arrays(reader: GGUFFile, arch: str, n_layers: int) -> frozenset[str]:
    """The model's per-layer arrays, refusing an array of one value per layer that the slicer
    does not know: copied whole, it would describe layers the slice does not hold."""
    known = {f"{arch}.{k}" for k in PER_LAYER_KEYS}
    found = set()
    for key, f in reader.fields.items():
        if not key.startswith(f"{arch}.") or f.types[0] != GGUFValueType.ARRAY:
            continue
        if key in known:
            found.add(key)
        elif key == f"{arch}.{SWA_PATTERN_KEY}" and arch in SWA_PATTERN:
            continue  # rewritten for each slice: see window_flags
        elif len(f.contents()) == n_layers:
            raise ModelError(f"cannot cut {key}: an array of one value per layer")
    return frozenset(found)


# Tokens a family's vocabulary must hold for llama.cpp to load it at all (its vocabulary
# loader looks them up by text): the placeholder holds them too.
REQUIRED_TOKENS = {"phi3": ("<|endoftext|>",)}


# Families whose output head is always the token embeddings (llama.cpp refuses an
# output.weight in their files).
TIED_HEAD = frozenset({"gemma", "gemma2", "cohere2"})


def window_flags(reader: GGUFFile, arch: str, n_layers: int) -> list[bool] | None:
    """Per layer of the whole model, whether llama.cpp gives it the sliding window, for the
    families that choose by index; None for the others."""
    default = SWA_PATTERN.get(arch)
    if default is None:
        return None
    f = reader.fields.get(f"{arch}.{SWA_PATTERN_KEY}")
    value = default if f is None else f.contents()
    if isinstance(value, list):
        if len(value) != n_layers:
            raise ModelError(
                f"{arch}.{SWA_PATTERN_KEY} has {len(value)} flags for {n_layers} layers"
            )
        return [bool(v) for v in value]
    n = int(value)
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]


def _add_placeholder_vocab(writer: gguf.GGUFWriter, arch: str, n_embd: int) -> None:
    n = PLACEHOLDER_VOCAB
    required = list(REQUIRED_TOKENS.get(arch, ()))
    rest = n - 3 - len(required)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *required] + [f"<t{i}>" for i in range(rest)])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types([2, 3, 3] + [3] * len(required) + [1] * rest)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_uint32(f"{arch}.vocab_size", n)
    writer.add_tensor("token_embd.weight", np.zeros((n, n_embd), np.float32))
    if arch not in TIED_HEAD:
        writer.add_tensor("output.weight", np.zeros((n, n_embd), np.float32))


def _finish(writer: gguf.GGUFWriter, dst: Path, tmp: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def pad_layer(
    layout: ModelLayout, start: int, end: int, windowed: Sequence[bool] | None = None
) -> int | None:
    """The model layer whose zeroed copy pads the slice [start, end), or None. `windowed`: the
    model's sliding-window flags (`window_flags`), for the families that alternate them.

    Every weight of the copy is zero: its mixer and FFN add exact zeros, so it hands its input
    on unchanged. It stands in for a kind of layer llama.cpp needs in the graph:
    - a hybrid's memory needs both kinds: a slice with no attention layer, or no state-space
      layer, fails inside llama_decode (an unallocated input);
    - a family with windowed layers asserts that a model has one (it aborts the process): a
      slice of only global layers gets a windowed copy.
    """
    if windowed is not None:
        if any(windowed[start:end]) or not any(windowed):
            return None
        sources = [i for i, w in enumerate(windowed) if w]
        return min(sources, key=lambda i: (layout.layer_bytes[i], i))
    traits = family_traits(layout)
    if traits.state_kind != "hybrid":
        return None
    held = set(traits.layer_types[start:end])
    missing = [k for k in (ATTENTION, RECURRENT) if k not in held]
    if not missing:
        return None
    sources = [i for i, k in enumerate(traits.layer_types) if k == missing[0]]
    if not sources:
        return None  # the whole model lacks it too: nothing to borrow
    return min(sources, key=lambda i: (layout.layer_bytes[i], i))


def _layer_copy(name: str, start: int, end: int, last: bool, shift: int = 0) -> str | None:
    """What the layers artifact for [start, end) calls the source tensor `name` (it copies
    that tensor's bytes), or None: it does not copy them. Its layers are numbered from
    `shift` (the padding layers before them are written as zeros and read no bytes)."""
    m = LAYER_TENSOR.match(name)
    if not m:
        keep = last or name not in ("token_embd.weight", "output.weight")
        return name if keep else None
    i = int(m.group(1))
    return f"blk.{i - start + shift}.{m.group(2)}" if start <= i < end else None


def tensors_read(layout: ModelLayout, kind: str, start: int, end: int) -> list[str]:
    """The source tensors whose bytes the artifact (`kind` "layers" for [start, end), or
    "entry") is cut from: all a download of just that artifact needs besides the header."""
    if kind == "entry":
        return ["token_embd.weight"]
    last = end == layout.n_layers
    standin = _has_standin(layout, start, end)
    reader = open_gguf(Path(layout.path))
    return [
        t.name
        for t in reader.tensors
        if _layer_copy(t.name, start, end, last) is not None
        and not (standin and t.name == "token_embd.weight")
    ]


def _has_standin(layout: ModelLayout, start: int, end: int) -> bool:
    """Whether the slice [start, end) carries zero embeddings in place of the model's: it
    ends the model but does not begin it, and the model has its own output head."""
    return end == layout.n_layers and start > 0 and not layout.tied_embeddings


def _zero_embeddings(writer: gguf.GGUFWriter, n_vocab: int, n_embd: int) -> None:
    """`token_embd.weight` of the right shape, all zeros, in the smallest type that fits."""
    name, per_block, block_bytes = embedding_standin(n_embd)
    if name == "F16":
        writer.add_tensor("token_embd.weight", np.zeros((n_vocab, n_embd), np.float16))
        return
    raw = np.zeros((n_vocab, n_embd // per_block * block_bytes), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType[name])


def write_layers(
    layout: ModelLayout, start: int, end: int, dst: Path, *, provenance: dict[str, str | int]
) -> None:
    """Write the layers artifact for [start, end) of `layout`'s model to `dst`."""
    if not 0 <= start < end <= layout.n_layers:
        whole = layer_range(0, layout.n_layers)
        raise ModelError(f"layer range {layer_range(start, end)} is outside {whole}")
    if layout.stage_refusal and (start, end) != (0, layout.n_layers):
        raise ModelError(f"cannot split {layout.name}: {layout.stage_refusal}")
    reader = open_gguf(Path(layout.path))
    arch = layout.architecture
    per_layer = _per_layer_arrays(reader, arch, layout.n_layers)
    flags = window_flags(reader, arch, layout.n_layers)
    pad = pad_layer(layout, start, end, flags)
    pads = [] if pad is None else [pad]
    # The slice's layers in order, as layers of the source model.
    sources = pads + list(range(start, end))
    last = end == layout.n_layers
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)

    def skip(key: str) -> bool:
        if key in (f"{arch}.block_count", f"{arch}.{LEADING_DENSE_KEY}"):
            return True
        if flags is not None and key == f"{arch}.{SWA_PATTERN_KEY}":
            return True
        if key.startswith(SLICE_KEY_PREFIX):
            return True
        return not last and (key.startswith(TOKENIZER_PREFIX) or key == f"{arch}.vocab_size")

    _copy_metadata(reader, writer, skip=skip, layers=sources, per_layer=per_layer)
    writer.add_uint32(f"{arch}.block_count", len(sources))
    lead = reader.fields.get(f"{arch}.{LEADING_DENSE_KEY}")
    if lead is not None:
        n_dense = _leading_dense(int(lead.contents()), sources)
        writer.add_uint32(f"{arch}.{LEADING_DENSE_KEY}", n_dense)
    if flags is not None:
        slice_flags = [flags[i] for i in sources]
        writer.add_array(f"{arch}.{SWA_PATTERN_KEY}", slice_flags)
    for key, value in provenance.items():
        if isinstance(value, int):
            writer.add_uint64(SLICE_KEY_PREFIX + key, value)
        else:
            writer.add_string(SLICE_KEY_PREFIX + key, value)
    if pads:  # absent otherwise: artifacts of other models keep their bytes (and hashes)
        writer.add_uint32(SLICE_KEY_PREFIX + PAD_LAYERS_KEY, len(pads))
    for t in reader.tensors:
        m = LAYER_TENSOR.match(t.name)
        if m and int(m.group(1)) == pad:
            # All-zero bytes are a zero weight in every ggml type (float or quantised blocks).
            writer.add_tensor(f"blk.0.{m.group(2)}", np.zeros_like(t.data), raw_dtype=t.tensor_type)
        name = _layer_copy(t.name, start, end, last, len(pads))
        if name == "token_embd.weight" and _has_standin(layout, start, end):
            _zero_embeddings(writer, layout.n_vocab, layout.n_embd)
        elif name is not None:
            writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    if not last:
        _add_placeholder_vocab(writer, arch, layout.n_embd)
    _finish(writer, dst, tmp)


def _leading_dense(lead: int, sources: Sequence[int]) -> int:
    """How many of a slice's layers (their source indices, in order) are dense, where the
    whole model's first `lead` are: they must lead the slice, as they lead the model."""
    dense = [i < lead for i in sources]
    n = sum(dense)
    if dense != [True] * n + [False] * (len(dense) - n):
        raise ModelError(f"the slice's dense layers do not lead it: {list(sources)}, {lead}")
    return n


def write_entry(layout: ModelLayout, dst: Path, *, provenance: dict[str, str | int]) -> None:
    """Write the entry artifact: every metadata key (tokenizer, chat template) and the token
    embeddings, no layers."""
    reader = open_gguf(Path(layout.path))
    tmp = dst.with_name(dst.name + ".partial")
    writer = gguf.GGUFWriter(tmp, layout.architecture)
    _copy_metadata(reader, writer, skip=lambda k: k.startswith(SLICE_KEY_PREFIX))
    for key, value in provenance.items():
        if isinstance(value, int):
            writer.add_uint64(SLICE_KEY_PREFIX + key, value)
        else:
            writer.add_string(SLICE_KEY_PREFIX + key, value)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelError(f"{layout.path} has no token_embd.weight")
    writer.add_tensor("token_embd.weight", embd.data, raw_dtype=embd.tensor_type)
    _finish(writer, dst, tmp)


class TokenEmbeddings:
    """Token embedding lookup from a GGUF (whole model or entry artifact), dequantising only
    the rows asked for: the first stage's input, scaled by sqrt(n_embd) for the families whose
    graph scales token input but not hidden states (`architectures.INPUT_SCALED_FOR_TOKENS`)."""

    def __init__(self, path: Path) -> None:
        reader = open_gguf(path)
        t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if t is None:
            raise ModelError(f"{path} has no token_embd.weight")
        self._data = t.data
        self._qtype = t.tensor_type
        self.n_vocab = int(t.shape[1])
        self.n_embd = int(t.shape[0])
        arch = reader.fields.get("general.architecture")
        scaled = arch is not None and arch.contents() in INPUT_SCALED_FOR_TOKENS
        # A float32 square root and float32 products, as llama.cpp's graph computes them.
        self._scale = np.sqrt(np.float32(self.n_embd)) if scaled else None
        self._rows: dict[int, np.ndarray] = {}  # decode steps look up one token at a time

    def __call__(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """The rows of `tokens`; OutOfRange for an id outside the vocabulary (numpy would
        read -1 as the last row)."""
        if len(tokens) == 1:
            token = int(tokens[0])
            row = self._rows.get(token)
            if row is None:
                self._check(token, token)
                row = self._lookup(np.asarray([token]))
                row.flags.writeable = False  # shared by every later lookup of this token
                self._rows[token] = row
            return row
        try:
            ids = np.asarray(tokens, dtype=np.int64)
        except OverflowError as e:
            raise OutOfRange(f"a token id outside the vocabulary (0-{self.n_vocab - 1})") from e
        if len(ids):
            self._check(int(ids.min()), int(ids.max()))
        return self._lookup(ids)

    def _check(self, low: int, high: int) -> None:
        if low < 0 or high >= self.n_vocab:
            bad = low if low < 0 else high
            raise OutOfRange(f"token id {bad} is outside the vocabulary (0-{self.n_vocab - 1})")

    def _lookup(self, tokens: np.ndarray) -> np.ndarray:
        rows = self._data[tokens]
        out = np.ascontiguousarray(gguf.quants.dequantize(rows, self._qtype), dtype=np.float32)
        if self._scale is not None:
            out *= self._scale
        return out
