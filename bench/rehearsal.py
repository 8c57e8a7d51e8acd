"""A rehearsal at a real model's shape: an 8B-shaped model split over three agent processes
against one process holding it whole.

The model is `bench/shape_model.py`'s random-weight GGUF of Llama 3 8B's shape (32 layers, width
4096, Q4_K, 4.5 GB), written on first use. First one agent with room for it serves it whole;
then three agents, each offering 40% of what it needs (so that no two can hold it), agree on a
three-stage split. Every agent runs with default settings otherwise (4 slots of 2048 tokens, a
thread per core). For each the script measures:

- load time: from the process's start to the model being routable, and the agents' own
  `load_s` (slicing and loading their part, from their logs), of which the check of verify
  windows a whole engine runs once loaded (`engine/windows.py`) is shown apart;
- each agent's peak resident memory (VmHWM) against what the plan reserved for its part
  (weights, KV cache for every slot, llama.cpp's compute buffer);
- greedy text for a few prompts, which must be identical;
- decode tokens/s of one stream;
- activation bytes per decoded token on each hop, from the links' byte counters over two
  requests that differ only in how many tokens they decode.

The whole agent is stopped before the split starts, so that each has the machine's cores to
itself. Prints a table and writes JSON.

    .venv/bin/python bench/rehearsal.py [--model PATH] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import result_file
import trio
from real_split import ask
from split import measure, start_split, wait_routable

from meshagent.launch import AgentProcess, start_agent
from meshagent.models.layout import inspect_model
from meshagent.placement.costs import ModelCost
from meshagent.wording import size

HERE = Path(__file__).resolve().parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
SLOTS, CTX = 4, 2048  # the agent's defaults, restated: the plan's KV cache follows from them
SHARE = 40  # percent of the model each split agent offers


def shape_model() -> Path:
    out = subprocess.run(
        [sys.executable, str(HERE / "shape_model.py")], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip())


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def _events(agent: AgentProcess) -> list[dict]:
    out = []
    for line in agent.log_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def load_seconds(agent: AgentProcess) -> tuple[float | None, float | None]:
    """The agent's own time to load its part (its log's last `mesh_model.part` event), and of
    that the check of its verify windows (from `engine.loaded` to `engine.windows_checked`),
    if it ran one."""
    load = loaded = checked = None
    for e in _events(agent):
        if e.get("event") == "mesh_model.part" and "load_s" in e:
            load = e["load_s"]
        elif e.get("event") == "engine.loaded":
            loaded = datetime.fromisoformat(e["timestamp"])
        elif e.get("event") == "engine.windows_checked" and loaded is not None:
            checked = (datetime.fromisoformat(e["timestamp"]) - loaded).total_seconds()
    return load, None if checked is None else round(checked, 2)


def status(agent: AgentProcess) -> dict:
    return httpx.get(f"{agent.url}/control/status", timeout=30).json()


def sent_to(agent: AgentProcess, peer: str) -> int:
    return sum(link["bytes_sent"] for link in status(agent)["peers"] if link["peer_id"] == peer)


def complete(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def answers(url: str, model: str, max_tokens: int) -> list[str]:
    return [ask(url, model, p, False, max_tokens)[0] for p in PROMPTS]


def decode_rate(url: str, model: str, max_tokens: int, runs: int = 3) -> float:
    """The median tokens/s of one stream over `runs` requests, after one that warms the
    prompt's prefix."""
    rates = [trio.run(measure, url, model, max_tokens, 1) for _ in range(runs + 1)]
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a GGUF file (default: bench/shape_model.py's)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/results/rehearsal.json"))
    args = ap.parse_args()
    path = args.model or shape_model()
    model = path.name.removesuffix(".gguf")
    layout = inspect_model(path)
    cost = ModelCost.from_layout(model, layout)
    context = SLOTS * CTX
    need = cost.stage_bytes(0, cost.n_layers, context)
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshagent-rehearsal-") as tmp:
        root = Path(tmp)
        # One process holding the whole model.
        began = time.monotonic()
        whole = start_agent(root / "whole", "--model", str(path), timeout=900)
        try:
            wait_routable([whole], model, timeout=900)
            whole_ready = time.monotonic() - began
            want = answers(whole.url, model, 32)
            whole_rate = decode_rate(whole.url, model, args.max_tokens)
            rows.append(
                {
                    "agent": "whole",
                    "layers": [0, cost.n_layers],
                    "reserved": need,
                    "peak_rss": peak_rss(whole.proc.pid),
                    **_loads(whole),
                }
            )
        finally:
            whole.stop()
        # Three processes, each offering too little to hold two thirds.
        offer = f"{need * SHARE // 100 // 1024}K"
        began = time.monotonic()
        with contextlib.ExitStack() as agents:
            flags = ["--model", str(path), "--max-memory", offer]
            entry, stages, in_order = start_split(root, agents, model, flags, timeout=900)
            split_ready = time.monotonic() - began
            got = answers(entry.url, model, 32)
            split_rate = decode_rate(entry.url, model, args.max_tokens)
            hops = _hop_bytes(in_order, [s[0] for s in stages], entry, model)
            for i, ((_, start, end, *_), a) in enumerate(zip(stages, in_order, strict=True)):
                rows.append(
                    {
                        "agent": f"stage {i + 1}",
                        "layers": [start, end],
                        "reserved": cost.stage_bytes(start, end, context),
                        "peak_rss": peak_rss(a.proc.pid),
                        **_loads(a),
                        "hop_bytes_per_token": hops[i],
                    }
                )
    same = sum(g == w for g, w in zip(got, want, strict=True))
    for r in rows:
        r["rss_over_reserved"] = round(r["peak_rss"] / r["reserved"], 3)
    _print(model, layout, rows, whole_ready, split_ready, whole_rate, split_rate, same)
    result_file.write(
        args.out,
        {
            "model": model,
            "file_bytes": layout.file_bytes,
            "n_layers": layout.n_layers,
            "n_embd": layout.n_embd,
            "slots": SLOTS,
            "ctx_size": CTX,
            "agents": rows,
            "ready_s": {"whole": round(whole_ready, 1), "split": round(split_ready, 1)},
            "decode_tok_s": {"whole": round(whole_rate, 2), "split": round(split_rate, 2)},
            "identical": same,
            "asked": len(PROMPTS),
            "whole_text": want,
            "split_text": got,
        },
    )
    if same != len(PROMPTS):
        raise SystemExit(1)


def _loads(agent: AgentProcess) -> dict:
    load, check = load_seconds(agent)
    return {"load_s": load, "windows_check_s": check}


def _hop_bytes(in_order: list, peers: list[str], entry, model: str) -> list[float]:
    """Bytes each stage sends the next (the last: the entry) per decoded token: two requests
    that differ only in how many tokens they decode, the difference in each link's counter
    over the difference in tokens. The prompt is the same, so its bytes cancel out."""
    prompt = "A rehearsal counts the bytes of every hop:"
    complete(entry.url, model, prompt, 1)  # the prefix is cached for both measured requests

    def counters() -> list[int]:
        return [sent_to(a, peers[(i + 1) % len(peers)]) for i, a in enumerate(in_order)]

    before = counters()
    short = complete(entry.url, model, prompt, 8)
    middle = counters()
    long = complete(entry.url, model, prompt, 72)
    after = counters()
    tokens = long - short
    return [
        round(((c - b) - (b - a)) / tokens) for a, b, c in zip(before, middle, after, strict=True)
    ]


def _or(value, missing: str = "?") -> str:
    return missing if value is None else f"{value:.1f}"


def _print(model, layout, rows, whole_ready, split_ready, whole_rate, split_rate, same) -> None:
    print(
        f"model {model}: {layout.n_layers} layers, width {layout.n_embd}, "
        f"{size(layout.file_bytes)}; {SLOTS} slots x {CTX} tokens"
    )
    print(
        f"{'agent':8} {'layers':>8} {'reserved':>10} {'peak RSS':>10} {'RSS/res':>8} "
        f"{'load s':>7} {'(check)':>8} {'hop B/token':>12}"
    )
    for r in rows:
        hop = r.get("hop_bytes_per_token")
        print(
            f"{r['agent']:8} {r['layers'][0]:>3}-{r['layers'][1]:<4} {size(r['reserved']):>10} "
            f"{size(r['peak_rss']):>10} {r['peak_rss'] / r['reserved']:8.2f} "
            f"{_or(r['load_s']):>7} {_or(r['windows_check_s'], '-'):>8} "
            f"{'' if hop is None else hop:>12}"
        )
    print(f"ready (start to routable): whole {whole_ready:.1f} s, split {split_ready:.1f} s")
    print(f"decode, one stream: whole {whole_rate:.2f} tok/s, split {split_rate:.2f} tok/s")
    print(f"{same} of {len(PROMPTS)} greedy answers identical")


if __name__ == "__main__":
    main()
