"""Many models on one mesh, end to end: traffic moves from model to model and the mesh follows.

Three agents offer `--max-memory` each (450M by default: Qwen2.5-Coder-1.5B Q4_K_M fits only
split over all three); the mesh's catalogue holds the embedded SmolLM2, the coder model
(`bench/coder_model.py`) and a tiny random-weight model. A client sends greedy requests to the
first agent's API in phases, each phase to one model; every answer is compared with the text
that model gives served alone (one agent of its own, whole), and each phase says how long its
first request took (a cold model loads for it) against the time the mesh took to load it
(from the request until the first agent's status says the model is routable) and an answer's
time once loaded, and which models were loaded (`/api/ps`) as the phase ended. Phases follow
each other at once; `/api/ps` is sampled throughout, which says when the model a phase left
unloaded (after its keep_alive, or sooner where the next model needed its memory). Prints a
table, writes JSON.

    .venv/bin/python bench/many_models.py [--keep-alive 20s] [--requests 4]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
import threading
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


def routable(agent: AgentProcess, model: str) -> bool:
    try:
        placement = httpx.get(f"{agent.url}/control/status", timeout=10).json()["placement"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return bool((placement.get(model) or {}).get("routable"))


class Loaded:
    """`/api/ps` sampled every 0.5 s: [(seconds since start, models loaded)]."""

    def __init__(self, agent: AgentProcess) -> None:
        self.began = time.monotonic()
        self.samples: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(agent,), daemon=True)
        self._thread.start()

    def _run(self, agent: AgentProcess) -> None:
        while not self._stop.is_set():
            try:
                now = frozenset(loaded(agent))
            except (httpx.HTTPError, ValueError, KeyError):
                now = None
            if now is not None:
                self.samples.append((time.monotonic() - self.began, now))
            time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def unloaded(self, model: str, after: float, before: float) -> float | None:
        """Seconds from `after` until `model` was first seen unloaded, if before `before`."""
        for t, models in self.samples:
            if after <= t < before and model not in models:
                return t - after
        return None


class LoadWatch:
    """Seconds from its start until `model` is routable on `agent` (polled every 0.1 s)."""

    def __init__(self, agent: AgentProcess, model: str) -> None:
        self.began, self.seconds = time.monotonic(), None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(agent, model), daemon=True)
        self._thread.start()

    def _run(self, agent: AgentProcess, model: str) -> None:
        while not self._stop.is_set():
            if routable(agent, model):
                self.seconds = time.monotonic() - self.began
                return
            time.sleep(0.1)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.seconds


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
    ap.add_argument("--keep", type=Path, help="run in this folder and keep it (agents' logs)")
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
        root = Path(tmp) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
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
        sampler = Loaded(a)
        for model in phases:
            firsts, texts_ok, n, warm, load_s = None, 0, 0, [], None
            cold = not routable(a, model)
            began = time.monotonic()
            watch = LoadWatch(a, model)
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
                    load_s = watch.stop() if cold else 0.0
                else:
                    warm.append(took)
            watch.stop()
            # What the first request waited beyond the load and an answer's own time.
            beyond = None
            if firsts is not None and load_s is not None and warm:
                beyond = firsts - load_s - statistics.median(warm)
            row = {
                "model": model,
                "requests": args.requests,
                "answered": n,
                "identical": texts_ok,
                "cold": cold,
                "first_s": firsts,
                "load_s": load_s if cold else None,
                "answer_s": statistics.median(warm) if warm else None,
                "beyond_load_s": beyond,
                "alone_load_s": reference[model]["load_s"],
                "phase_s": time.monotonic() - began,
                "ended_at": time.monotonic() - sampler.began,
                "loaded_after": loaded(a),
            }
            rows.append(row)
            print(
                f"  {model:<40} {n}/{args.requests} answered, {texts_ok} identical, "
                f"{'cold' if cold else 'loaded'}, first {_s(firsts)} s (load {_s(row['load_s'])} "
                f"s, answer {_s(row['answer_s'])} s, beyond both {_s(beyond)} s); loaded: "
                f"{', '.join(row['loaded_after'])}",
                flush=True,
            )
        time.sleep(_seconds(args.keep_alive) + 8)  # past keep_alive: the last model unloads
        sampler.stop()
        for i, row in enumerate(rows):
            # When the model this phase left unloaded: before its next phase, if any.
            again = [r for r in rows[i + 1 :] if r["model"] == row["model"]]
            until = again[0]["ended_at"] - again[0]["phase_s"] if again else math.inf
            row["unloaded_after_s"] = sampler.unloaded(row["model"], row["ended_at"], until)

    print(
        f"\n{'phase (model)':<38}{'answered':>9}{'identical':>10}{'first s':>8}{'load s':>7}"
        f"{'answer s':>9}{'beyond':>7}{'unloaded after s':>17}"
    )
    for r in rows:
        print(
            f"{r['model']:<38}{r['answered']:>9}{r['identical']:>10}{_s(r['first_s']):>8}"
            f"{_s(r['load_s']):>7}{_s(r['answer_s']):>9}{_s(r['beyond_load_s']):>7}"
            f"{_s(r['unloaded_after_s']):>17}"
        )
    worst = max((r["beyond_load_s"] for r in rows if r["cold"] and r["beyond_load_s"]), default=0)
    print(f"cold first requests waited at most {worst:.2f} s beyond load and answer (goal <= 2)")
    print(
        f"unloaded after: seconds from a phase's last answer until /api/ps lacks its model "
        f"(keep_alive {args.keep_alive}; sooner where the next model needed its memory; "
        "- : asked for again first, or pinned)"
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


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _seconds(duration: str) -> float:
    from meshagent.placement.demand import keep_alive_seconds

    seconds = keep_alive_seconds(duration)
    assert seconds is not None
    return max(seconds, 0.0)


if __name__ == "__main__":
    main()
