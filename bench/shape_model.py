"""Write a random-weight GGUF at a real model's shape, and print its path.

The rehearsal (`bench/rehearsal.py`) needs a model as wide and as deep as the ones people split,
and the only real models this machine can fetch are 135M and 1.5B. This script writes one of
Llama 3 8B's shape: 32 layers, width 4096, 32 query heads over 8 key/value heads, a 14336-wide
FFN, a 128256-token vocabulary, every matrix in Q4_K (4.5 bits a weight, about 4.5 GB in all).
The Q4_K blocks are written directly: random 4-bit quants and 6-bit scales under one fp16 scale
and minimum per block, chosen so that weights have a mean near 0 and a spread near
1/sqrt(width), as a trained model's do; quantizing float weights through llama.cpp would take
32 GB of float32 first. The vocabulary is byte tokens and fillers, so any text tokenizes.

The file goes under ~/.cache/meshagent/bench/ (or `--dir`) and is never committed; a second run
finds it and prints its path. Writing takes about a minute and holds one layer in memory.

    .venv/bin/python bench/shape_model.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q4_K = gguf.GGMLQuantizationType.Q4_K
BLOCK_WEIGHTS, BLOCK_BYTES = gguf.GGML_QUANT_SIZES[Q4_K]  # 256 weights in 144 bytes


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rope_base: float = 500000.0
    context: int = 8192


LLAMA3_8B = Shape("llama-8b-shape", 32, 4096, 32, 8, 14336, 128256)
# A small shape of the same kind, for checking this script quickly (`--shape tiny`).
TINY = Shape("llama-tiny-shape", 4, 512, 8, 2, 1024, 1024)
SHAPES = {"8b": LLAMA3_8B, "tiny": TINY}


def q4k_scale(n_in: int, rng: np.random.Generator) -> tuple[np.float16, np.float16]:
    """The block scale `d` and minimum `dmin` that give dequantized weights a spread near
    1/sqrt(n_in) and a mean near 0, measured on sample blocks of random bytes."""
    sample = random_blocks(rng, 4096, np.float16(1.0), np.float16(7.5))
    values = gguf.quants.dequantize(sample.reshape(1, -1), Q4_K)
    d = (1 / np.sqrt(n_in)) / float(values.std())
    return np.float16(d), np.float16(7.5 * d)


def random_blocks(rng: np.random.Generator, n: int, d: np.float16, dmin: np.float16) -> np.ndarray:
    """`n` Q4_K blocks: random quants and scales, every block's d and dmin as given."""
    blocks = np.frombuffer(rng.bytes(n * BLOCK_BYTES), dtype=np.uint8).reshape(n, BLOCK_BYTES)
    blocks = blocks.copy()
    blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[:, 2:4] = np.frombuffer(dmin.tobytes(), dtype=np.uint8)
    return blocks


def tensors(shape: Shape) -> list[tuple[str, int, int]]:
    """Every tensor as (name, rows, cols); cols 0 for a norm's vector of `rows`."""
    e, kv = shape.n_embd, shape.n_embd // shape.n_head * shape.n_head_kv
    out = [("token_embd.weight", shape.n_vocab, e)]
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", e, 0),
            (p + "attn_q.weight", e, e),
            (p + "attn_k.weight", kv, e),
            (p + "attn_v.weight", kv, e),
            (p + "attn_output.weight", e, e),
            (p + "ffn_norm.weight", e, 0),
            (p + "ffn_gate.weight", shape.n_ff, e),
            (p + "ffn_up.weight", shape.n_ff, e),
            (p + "ffn_down.weight", e, shape.n_ff),
        ]
    return [*out, ("output_norm.weight", e, 0), ("output.weight", shape.n_vocab, e)]


def _vocabulary(w: gguf.GGUFWriter, n_vocab: int) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    fillers = n_vocab - len(tokens)
    tokens += [f"\u2581w{i}" for i in range(fillers)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i + 1) for i in range(fillers)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * fillers)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_shape_model(path: Path, shape: Shape, seed: int = 0) -> Path:
    """Write `shape` to `path` through a temporary name, so the file appears only whole.
    Tensor data is made and written one tensor at a time."""
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(shape.name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layers)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.n_embd // shape.n_head)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _vocabulary(w, shape.n_vocab)
    specs = tensors(shape)
    for name, rows, cols in specs:
        if cols:
            nbytes = rows * cols // BLOCK_WEIGHTS * BLOCK_BYTES
            w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), nbytes, raw_dtype=Q4_K)
        else:
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    scales = {cols: q4k_scale(cols, rng) for cols in {c for _, _, c in specs if c}}
    for _, rows, cols in specs:
        if cols:
            per_row = cols // BLOCK_WEIGHTS
            blocks = random_blocks(rng, rows * per_row, *scales[cols])
            w.write_tensor_data(blocks.reshape(rows, per_row * BLOCK_BYTES))
        else:
            w.write_tensor_data((1.0 + 0.05 * rng.standard_normal(rows)).astype(np.float32))
    w.close()
    tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/meshagent/bench")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    path = args.dir / f"{shape.name}-q4_k.gguf"
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        write_shape_model(path, shape)
    print(path)


if __name__ == "__main__":
    main()
