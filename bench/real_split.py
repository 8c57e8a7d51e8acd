"""A real model split over three agent processes gives the whole model's greedy text.

Three agents on loopback, each offering 49% of what the model needs (so no one or two can hold
it), agree on a three-stage split with default flags otherwise; one agent with room enough
serves it whole. Each prompt is asked of both, as a text completion and as a chat, greedy, and
the texts are compared. Prints a table and writes JSON.

    .venv/bin/python bench/real_split.py                          # the embedded SmolLM2
    .venv/bin/python bench/real_split.py --model "$(.venv/bin/python bench/coder_model.py)"
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import httpx
import result_file
from split import start_split

from meshagent.launch import start_agent
from meshagent.models.default import resolve_model
from meshagent.models.layout import inspect_model

PROMPTS = [
    "def fibonacci(n):",
    "The three largest rivers in Europe are",
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
]
SETTINGS = ["--slots", "2", "--ctx-size", "512"]


def share(model: Path) -> str:
    """49% of the model's weights and its KV cache for SETTINGS' slots, as --max-memory."""
    layout = inspect_model(model)
    kv = layout.kv_bytes_per_token_per_layer * layout.n_layers * 2 * 512
    return f"{(layout.file_bytes + kv) * 49 // 100 // 1024}K"


def ask(url: str, model: str, prompt: str, chat: bool, max_tokens: int) -> tuple[str, float]:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"], time.perf_counter() - t0
    body["prompt"] = prompt
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_split.json"))
    args = ap.parse_args()
    path = args.model or resolve_model("")
    model = path.name.removesuffix(".gguf")
    small = ["--model", str(path), "--max-memory", share(path), *SETTINGS]
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp,
        contextlib.ExitStack() as agents,
    ):
        root = Path(tmp)
        entry, stages, _ = start_split(root, agents, model, small)
        whole = start_agent(root / "whole", "--model", str(path), *SETTINGS)
        agents.callback(whole.stop)
        for prompt in PROMPTS:
            for chat in (False, True):
                want, whole_s = ask(whole.url, model, prompt, chat, args.max_tokens)
                got, split_s = ask(entry.url, model, prompt, chat, args.max_tokens)
                rows.append(
                    {
                        "prompt": prompt,
                        "chat": chat,
                        "same": got == want,
                        "whole_s": round(whole_s, 2),
                        "split_s": round(split_s, 2),
                        "whole": want,
                        "split": got,
                    }
                )
    same = sum(r["same"] for r in rows)
    print(f"model {model}: {len(stages)} stages, layers {[s[1:3] for s in stages]}")
    print(f"{'prompt':48} {'kind':5} {'same':5} {'whole s':>8} {'split s':>8}")
    for r in rows:
        kind = "chat" if r["chat"] else "text"
        print(
            f"{r['prompt'][:48]:48} {kind:5} {r['same']!s:5} "
            f"{r['whole_s']:8.2f} {r['split_s']:8.2f}"
        )
    print(f"{same} of {len(rows)} answers identical")
    result_file.write(
        args.out,
        {"model": model, "stages": stages, "rows": rows, "identical": same, "asked": len(rows)},
    )
    if same != len(rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
