"""GGUFFile reads what gguf.GGUFReader reads, from the same files, and refuses what is not a
GGUF with a ModelError."""

from __future__ import annotations

import gguf
import pytest

from meshagent.errors import ModelError
from meshagent.models.gguf_file import GGUFFile
from meshagent.models.layout import open_gguf
from meshagent.testing.tiny_gguf import write_tiny_jamba, write_tiny_mamba, write_tiny_model


def _same_as_gguf_reader(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        a, b = ours.fields[key], theirs.fields[key]
        assert a.types == list(b.types), key
        assert a.contents() == b.contents(), key
        assert type(a.contents()) is type(b.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            list(b.shape),
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        ), a.name
        assert (a.data.shape, a.data.dtype) == (b.data.shape, b.data.dtype), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_the_embedded_model_reads_as_gguf_reads_it(model_path):
    _same_as_gguf_reader(model_path)


@pytest.mark.parametrize("write", [write_tiny_model, write_tiny_mamba, write_tiny_jamba])
def test_tiny_models_read_as_gguf_reads_them(write, tmp_path):
    path = tmp_path / "m.gguf"
    if write is write_tiny_model:
        write(path, "llama")
    else:
        write(path)
    _same_as_gguf_reader(path)


def test_what_is_not_a_whole_gguf_is_a_model_error(model_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(model_path.read_bytes()[:200_000])  # the header, not all the tensors
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(model_path.read_bytes()[:30])  # magic, version, then nothing whole
    for path in (cut, text, stub):
        with pytest.raises(ModelError, match="not a readable GGUF"):
            open_gguf(path)
