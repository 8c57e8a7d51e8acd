"""Many models on one mesh, end to end: traffic moves from model to model and the mesh follows.

Three agents offer `--max-memory` each (450M by default: Qwen2.5-Coder-1.5B Q4_K_M fits only
split over all three); the mesh's catalogue holds the embedded SmolLM2, the coder model
(`bench/coder_model.py`) and a tiny random-weight model. A client sends greedy requests to the
first agent's API in phases, each phase to one model; every answer is compared with the text
that model gives served alone (one agent of its own, whole), and each phase says how long its
first request took (a cold model loads for it) against that model's load time measured alone,
and which models were loaded (`/api/ps`) as the phase ended. Between phases the client waits
past the models' keep_alive, so the model it left unloads. Prints a table, writes JSON.

    .venv/bin/python bench/many_models.py [--keep-alive 20s] [--requests 4]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import result_file

from meshagent.launch import AgentProcess, start_agent
from meshagent.models.default import default_model_path
from meshagent.testing.tiny_gguf import write_tiny_model

SETTINGS = ["--slots", "2", "--ctx-size", "512", "--threads", "1"]
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef mean(xs):",
]


def complete(agent: AgentProcess, model: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    began = time.monotonic()
    r = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=900)
    took = time.monotonic() - began
    if r.status_code != 200:
        raise RuntimeError(f"{model}: {r.status_code} {r.text[:300]}")
    return r.json()["choices"][0]["text"], took


def loaded(agent: AgentProcess) -> list[str]:
    return sorted(m["model"] for m in httpx.get(f"{agent.url}/api/ps", timeout=10).json()["models"])


def alone(root: Path, name: str, path: Path, max_tokens: int) -> dict[str, Any]:
    """`path` served whole by an agent of its own: the reference texts and its load time (from
    start to served, the agent's own start included)."""
    began = time.monotonic()
    agent = start_agent(root / f"alone-{name}", "--model", str(path), *SETTINGS, timeout=600)
    load_s = time.monotonic() - began
    try:
        texts = [complete(agent, name, p, max_tokens)[0] for p in PROMPTS]
    finally:
        agent.stop()
    return {"texts": texts, "load_s": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-memory", default="450M")
    ap.add_argument("--keep-alive", default="20s")
    ap.add_argument("--requests", type=int, default=4, help="requests per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench/results/many_models.json"))
    args = ap.parse_args()
    coder = Path(
        subprocess.run(
            [sys.executable, str(Path(__file__).parent / "coder_model.py")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-many-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        root = Path(tmp)
        tiny = write_tiny_model(root / "tiny-random.gguf", "llama", seed=11)
        smol = default_model_path()
        files = {"tiny-random": tiny, smol.stem: smol, coder.stem: coder}
        print("each model alone (the answers to match, and its load time) ...", flush=True)
        reference = {name: alone(root, name, path, args.max_tokens) for name, path in files.items()}

        mesh = [*SETTINGS, "--max-memory", args.max_memory, "--keep-alive", args.keep_alive]
        # a pins the tiny model it is started with (a few MB); the other two it adds.
        a = start_agent(root / "a", *mesh, "--model", str(tiny), timeout=120)
        stack.callback(a.stop)
        token = subprocess.run(
            [sys.executable, "-m", "meshagent", "invite", "--data-dir", str(a.data_dir)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for name in "bc":
            x = start_agent(root / name, *mesh, "--join", token, timeout=120)
            stack.callback(x.stop)
        for name in (smol.stem, coder.stem):
            r = httpx.post(f"{a.url}/control/models", json={"model": str(files[name])}, timeout=600)
            r.raise_for_status()
        keep = httpx.get(f"{a.url}/control/status", timeout=10).json()
        print(f"mesh of 3 agents offering {args.max_memory} each; keep_alive {args.keep_alive}")

        phases = [coder.stem, smol.stem, coder.stem, "tiny-random", smol.stem]
        rows, failures = [], 0
        for model in phases:
            firsts, texts_ok, n = None, 0, 0
            began = time.monotonic()
            for i in range(args.requests):
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    text, took = complete(a, model, prompt, args.max_tokens)
                except RuntimeError as e:
                    failures += 1
                    print(f"  FAILED {e}", flush=True)
                    continue
                n += 1
                texts_ok += text == reference[model]["texts"][i % len(PROMPTS)]
                if firsts is None:
                    firsts = took
            row = {
                "model": model,
                "requests": args.requests,
                "answered": n,
                "identical": texts_ok,
                "first_s": firsts,
                "alone_load_s": reference[model]["load_s"],
                "phase_s": time.monotonic() - began,
                "loaded_after": loaded(a),
            }
            rows.append(row)
            print(
                f"  {model:<40} {n}/{args.requests} answered, {texts_ok} identical, first "
                f"{firsts if firsts is None else round(firsts, 2)} s (load alone "
                f"{row['alone_load_s']:.1f} s); loaded: {', '.join(row['loaded_after'])}",
                flush=True,
            )
            time.sleep(_seconds(args.keep_alive) + 5)  # past keep_alive: the model unloads
            row["loaded_after_keep_alive"] = loaded(a)

    print(f"\n{'phase (model)':<42}{'answered':>9}{'identical':>10}{'first s':>9}{'load s':>8}")
    for r in rows:
        first = f"{r['first_s']:.2f}" if r["first_s"] is not None else "-"
        print(
            f"{r['model']:<42}{r['answered']:>9}{r['identical']:>10}{first:>9}"
            f"{r['alone_load_s']:>8.1f}   then loaded: {', '.join(r['loaded_after_keep_alive'])}"
        )
    print(f"failed requests: {failures}")
    result_file.write(
        args.out,
        {
            "benchmark": "many_models",
            "max_memory": args.max_memory,
            "keep_alive": args.keep_alive,
            "phases": rows,
            "failures": failures,
            "status_at_start": keep.get("assignment"),
            "machine": result_file.machine(),
        },
    )


def _seconds(duration: str) -> float:
    from meshagent.placement.demand import keep_alive_seconds

    seconds = keep_alive_seconds(duration)
    assert seconds is not None
    return max(seconds, 0.0)


if __name__ == "__main__":
    main()
