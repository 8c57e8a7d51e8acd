"""A GGUF file's metadata and tensor index, read in one pass over its header.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, which for a
tokenizer of 49k tokens and 48k merges takes seconds on a slow core; cutting a stage, loading
an entry and inspecting a model each paid that. `GGUFFile` parses the same header with
`struct` and slices of one memory map, and gives the same values: each metadata key's types
and contents (Python values, as `ReaderField.contents()` gives them) and each tensor's name,
type, shape, sizes and data (a read-only numpy view shaped as `GGUFReader` shapes it).
Little-endian files only (what llama.cpp writes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)
TOKENIZER_PREFIX = "tokenizer."  # metadata only the first and last stages of a split carry

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
# Tensor types whose data `GGUFReader` views as numbers rather than bytes.
_PLAIN: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class Field:
    """One metadata key: `types` is [type], or [ARRAY, element type]."""

    types: list[GGUFValueType]
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims as the file lists them (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class HeaderTruncated(ValueError):
    """The bytes given end inside the header: more are needed to read it."""


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.at)
        except struct.error as e:
            raise HeaderTruncated(f"the header ends early: {e}") from e
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.at
        self.at += n
        if self.at > len(self.buf):
            raise HeaderTruncated("string runs past the end of the file")
        return str(self.buf[start : self.at], "utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata type {kind}")
        return self.unpack(fmt)

    def array(self) -> tuple[GGUFValueType, list[Any]]:
        kind = GGUFValueType(self.unpack("<I"))
        n = self.unpack("<Q")
        if kind == GGUFValueType.STRING:
            return kind, [self.string() for _ in range(n)]
        if kind == GGUFValueType.ARRAY:
            raise ValueError("nested metadata arrays are not supported")
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata type {kind}")
        dtype = np.dtype(fmt)
        end = self.at + n * dtype.itemsize
        if end > len(self.buf):
            raise HeaderTruncated("array runs past the end of the file")
        values = np.frombuffer(self.buf[self.at : end], dtype=dtype).tolist()
        self.at = end
        return kind, values


Gap = tuple[int, int, int]  # [start, end) of `count` whole metadata entries left unread


@dataclass(frozen=True)
class Header:
    """What a GGUF header says: its metadata, each tensor's (name, dims, type, offset within
    the data section), and where that section starts. `spans` gives each metadata entry's
    [start, end) in the file; `gaps` the entries skipped unread (their keys are not known)."""

    fields: dict[str, Field]
    infos: list[tuple[str, list[int], GGMLQuantizationType, int]]
    data_offset: int
    spans: dict[str, tuple[int, int]]
    gaps: tuple[Gap, ...] = ()


def parse_header(buf: memoryview | bytes, gaps: tuple[Gap, ...] = ()) -> Header:
    """Parse the header at the start of `buf`, which may be only a prefix of the file:
    HeaderTruncated when it ends before the header does, ValueError when it is not one.
    Each gap (start, end, count) is `count` whole metadata entries starting at `start` that
    are skipped unread (the bytes there need not be here); one that does not start where an
    entry does, or holds more entries than are left, is a ValueError."""
    return _parse(_Cursor(memoryview(buf)), {start: (end, n) for start, end, n in gaps})


def _parse(c: _Cursor, gaps: dict[int, tuple[int, int]]) -> Header:
    if c.unpack("<I") != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version = c.unpack("<I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} (big-endian, or unknown) is not supported")
    n_tensors, n_fields = c.unpack("<Q"), c.unpack("<Q")
    fields: dict[str, Field] = {}
    spans: dict[str, tuple[int, int]] = {}
    skipped: list[Gap] = []
    left = n_fields
    while left > 0:
        start = c.at
        gap = gaps.get(start)
        if gap is not None:
            end, count = gap
            if not 0 < count <= left or end <= start:
                raise ValueError(f"a metadata gap at {start} does not fit the header")
            c.at, left = end, left - count
            skipped.append((start, end, count))
            continue
        left -= 1
        key = c.string()
        kind = GGUFValueType(c.unpack("<I"))
        if kind == GGUFValueType.ARRAY:
            sub, values = c.array()
            f = Field([kind, sub], values)
        else:
            f = Field([kind], c.value(kind))
        if key in fields:
            raise ValueError(f"duplicate metadata key {key}")
        fields[key] = f
        spans[key] = (start, c.at)
    if len(skipped) != len(gaps):
        raise ValueError("a metadata gap does not start where an entry does")
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        dims = [c.unpack("<Q") for _ in range(n_dims)]
        kind = GGMLQuantizationType(c.unpack("<I"))
        infos.append((name, dims, kind, c.unpack("<Q")))
    align = fields.get("general.alignment")
    alignment = GGUF_DEFAULT_ALIGNMENT
    if align is not None:
        if align.types != [GGUFValueType.UINT32]:
            raise ValueError("bad type for general.alignment")
        alignment = align.value
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a non-zero power of two")
    return Header(fields, infos, -(-c.at // alignment) * alignment, spans, tuple(skipped))


def tensor_bytes(dims: list[int], kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return int(np.prod(dims)) * size // block


class GGUFFile:
    """`fields` (key -> Field, in file order) and `tensors` of the GGUF at `path`, read
    around `gaps` (see `parse_header`). Raises ValueError (or OSError) for a file that is not
    one."""

    def __init__(self, path: Path | str, gaps: tuple[Gap, ...] = ()) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        header = parse_header(memoryview(self.data), gaps)
        self.gaps = header.gaps
        self.spans = header.spans
        self.fields = header.fields
        self.data_offset = header.data_offset
        self.tensors = [self._tensor(*info) for info in header.infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def _tensor(
        self, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int
    ) -> Tensor:
        n_elements = int(np.prod(dims))
        n_bytes = tensor_bytes(dims, kind)
        start = self.data_offset + offset
        if start + n_bytes > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        shape = tuple(reversed(dims))
        raw = self.data[start : start + n_bytes]
        plain = _PLAIN.get(kind)
        if plain is None:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        else:
            data = raw.view(plain).reshape(shape)
        return Tensor(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data)
