"""Stage engine speed: whole-model llama.cpp vs the same model in 3 stages in one process
(hidden states handed from stage to stage in the wire dtype) vs the numpy reference engine.

Prefill: one 256-token prompt. Decode: greedy tokens one at a time. Rounds alternate between
engines; the median is reported. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import result_file

from meshagent.engine.base import ForwardItem
from meshagent.engine.llama import LlamaEngine
from meshagent.engine.runtime import EmbdItem
from meshagent.engine.split_in_process import StagedEngine
from meshagent.models.artifacts import ArtifactStore
from meshagent.models.default import default_model_path
from meshagent.models.slicer import TokenEmbeddings
from meshagent.testing.numpy_ref import NumpyStage

TEXT = "The keeper of the northern lighthouse kept a log of every ship that passed. " * 30


def time_engine(engine, prompt: list[int], steps: int) -> tuple[float, float]:
    engine.clear_sequence(0)
    t0 = time.perf_counter()
    logits = engine.forward([ForwardItem(0, 0, prompt, True)])[0]
    t1 = time.perf_counter()
    pos = len(prompt)
    for _ in range(steps):
        logits = engine.forward([ForwardItem(0, pos, [int(np.argmax(logits))], True)])[0]
        pos += 1
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), steps / (t2 - t1)


class NumpyWhole:
    """The numpy engine over the whole model, with llama-style token input."""

    def __init__(self, model: Path) -> None:
        self.embed = TokenEmbeddings(model)
        self.stage = NumpyStage(model, start=0, end=inspect_layers(model))

    def forward(self, items):
        return self.stage.forward(
            [EmbdItem(it.seq_id, it.pos, self.embed(list(it.tokens)), True) for it in items]
        ).logits

    def clear_sequence(self, seq: int) -> None:
        self.stage.clear_sequence(seq)

    def memory_bytes(self) -> int:
        arrays = [a for layer in self.stage.layers for a in vars(layer).values()]
        arrays += [self.stage.output, self.stage.output_norm]
        return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))


def wire_bytes_per_token(name: str, info) -> int | None:
    """Bytes one decode step's hidden state costs on one hop between stages: the stage message
    as encoded, before the overlay's framing and AEAD tag."""
    from meshagent.models.layout import inspect_model
    from meshagent.serving import stage_messages as sm

    dtype = {"f32 wire": np.float32, "f16 wire": np.float16}.get(name.split(", ")[-1])
    if dtype is None:
        return None
    n_embd = inspect_model(Path(info.path)).n_embd
    msg = sm.Forward((sm.ForwardItem(0, 100, 1, True),), np.zeros((1, n_embd), dtype), (1.0,))
    return len(sm.encode(msg))


def inspect_layers(model: Path) -> int:
    from meshagent.models.layout import inspect_model

    return inspect_model(model).n_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--numpy-decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--split", default="0,10,20,30", help="stage boundaries")
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine.json"))
    args = ap.parse_args()
    model = default_model_path()
    bounds = [int(x) for x in args.split.split(",")]
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        store = ArtifactStore(Path(tmp))
        kw = {"slots": 1, "slot_ctx": 1024, "threads": args.threads}
        engines = {
            "llama.cpp whole": LlamaEngine(model, flash_attn=False, **kw),
            f"{len(bounds) - 1} stages, f32 wire": StagedEngine(model, bounds, store, **kw),
            f"{len(bounds) - 1} stages, f16 wire": StagedEngine(
                model, bounds, store, wire_dtype="f16", **kw
            ),
            "numpy reference": NumpyWhole(model),
        }
        prompt = engines["llama.cpp whole"].tokenize(TEXT, add_bos=True)[: args.prompt_tokens]
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, eng in engines.items():
                steps = args.numpy_decode_steps if "numpy" in name else args.decode_steps
                runs[name].append(time_engine(eng, prompt, steps))
        memory: dict[str, object] = {
            name: (
                [s.memory_bytes() for s in eng.stages]
                if isinstance(eng, StagedEngine)
                else eng.memory_bytes()
            )
            for name, eng in engines.items()
        }
    whole = runs["llama.cpp whole"]
    rows = []
    print(
        f"{'engine':<24}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ratio':>14}"
        f"{'wire B/token':>14}  memory"
    )
    for name, r in runs.items():
        prefill = statistics.median(p for p, _ in r)
        decode = statistics.median(d for _, d in r)
        # Each round times every engine back to back: the ratio within a round sees one
        # state of this (noisy) machine, so the median of those ratios is the steadier figure.
        per_round = [d / w for (_, d), (_, w) in zip(r, whole, strict=True)]
        ratio = statistics.median(per_round)
        wire = wire_bytes_per_token(name, engines["llama.cpp whole"].info)
        mem = memory[name]
        mem_text = (
            " + ".join(f"{m / 2**20:.0f}" for m in mem) + " MiB"
            if isinstance(mem, list)
            else f"{mem / 2**20:.0f} MiB"
        )
        wire_text = "-" if wire is None else str(wire)
        print(f"{name:<24}{prefill:>15.1f}{decode:>14.1f}{ratio:>14.3f}{wire_text:>14}  {mem_text}")
        rows.append(
            {
                "engine": name,
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "decode_ratio_vs_whole": ratio,
                "decode_ratio_per_round": per_round,
                "wire_bytes_per_token_per_hop": wire,
                "memory_bytes": mem,
                "rounds": r,
            }
        )
    result = {
        "benchmark": "engine",
        "model": model.name,
        "split": bounds,
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "decode_steps": args.decode_steps,
        "numpy_decode_steps": args.numpy_decode_steps,
        "results": rows,
        "machine": result_file.machine(),
    }
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
