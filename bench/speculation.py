"""Speculative decoding: decode speed with drafts from a request's own text against without.

One agent on loopback serves the embedded model. Each workload is a greedy chat request, sent
with `"meshagent": {"speculation": MODE}` for each mode in turn, several rounds, interleaved so
that the machine's other load touches every mode alike. Decode tokens/s runs from the first
streamed text to the end of the stream (the prompt's prefill is left out), over the completion
tokens after the first. Two workloads are copy-shaped (the answer repeats much of the prompt:
a JSON document with one field changed, a code block with a variable renamed), one is novel
prose, where drafts rarely fit. The texts of all modes must be identical (greedy); the script
says so per workload. Prints a table and writes JSON (default bench/results/speculation.json).
Never asserts on time: compare the figures yourself.

    .venv/bin/python bench/speculation.py [--rounds 3] [--max-tokens 256] [--modes off,auto,on]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from meshagent.launch import start_agent

DOC = {
    "name": "meshagent",
    "version": "0.4.2",
    "description": "a peer-to-peer mesh that runs language models on the machines you have",
    "license": "Apache-2.0",
    "api": {"host": "127.0.0.1", "port": 9337, "endpoints": ["/v1/models", "/v1/completions"]},
    "overlay": {"listen": "0.0.0.0:9338", "relays": ["relay.example.org:9339"], "mdns": True},
    "limits": {"slots": 4, "ctx_size": 2048, "max_queue": 64, "grace_seconds": 10},
}
CODE = """def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["amount"]
            count += 1
    average = total / count if count else 0.0
    print(f"total={total} count={count} average={average:.2f}")
    return {"total": total, "count": count, "average": average}
"""
WORKLOADS = {
    "json": "Here is a JSON document:\n"
    + json.dumps(DOC, indent=2)
    + '\nRepeat the whole document exactly as it is, except that "port" 9337 becomes 9400. '
    "Answer with the JSON only.",
    "code": "Here is a Python function:\n```python\n"
    + CODE
    + "```\nRewrite it with the variable `total` renamed to `running_sum`, changing nothing "
    "else. Answer with the code only.",
    "prose": "Write a long, detailed story about a lighthouse keeper who finds a map.",
}
COPY_SHAPED = ("json", "code")


def one(url: str, model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "meshagent": {"speculation": mode},
    }
    text, usage, first = "", None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                text += chunk["choices"][0]["delta"]["content"]
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert usage is not None and first is not None
    tokens = usage["completion_tokens"]
    spec = (usage.get("meshagent") or {}).get("speculation") or {}
    return {
        "text": text,
        "tokens": tokens,
        "tok_s": (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0,
        "drafted": spec.get("drafted", 0),
        "accepted": spec.get("accepted", 0),
        "windows": spec.get("windows", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--modes", default="off,auto", help="comma-separated; the first is the base")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/speculation.json"))
    args = ap.parse_args()
    modes = args.modes.split(",")
    runs: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in modes} for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        agent = start_agent(Path(tmp), "--threads", str(args.threads))
        try:
            url = agent.url
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            one(url, model, "Hello", "off", 8)  # warm up
            for r in range(args.rounds):
                for w, prompt in WORKLOADS.items():
                    order = modes if r % 2 == 0 else modes[::-1]
                    for m in order:
                        runs[w][m].append(one(url, model, prompt, m, args.max_tokens))
        finally:
            agent.stop()

    base = modes[0]
    table = {}
    for w in WORKLOADS:
        row: dict = {"identical": True}
        base_rate = statistics.median(x["tok_s"] for x in runs[w][base])
        for m in modes:
            xs = runs[w][m]
            rate = statistics.median(x["tok_s"] for x in xs)
            drafted = sum(x["drafted"] for x in xs)
            accepted = sum(x["accepted"] for x in xs)
            row[m] = {
                "tok_s": round(rate, 1),
                "runs_tok_s": [round(x["tok_s"], 1) for x in xs],
                "tokens": xs[0]["tokens"],
                "vs_base": round(rate / base_rate, 3) if base_rate else None,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "accepted_per_token": round(accepted / sum(x["tokens"] for x in xs), 3),
            }
            row["identical"] &= all(x["text"] == runs[w][base][0]["text"] for x in xs)
        row["goal"] = ">= 2.0x" if w in COPY_SHAPED else ">= 0.97x"
        table[w] = row

    result = {
        "benchmark": "speculation",
        "threads": args.threads,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "modes": modes,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workloads": table,
    }
    head = f"{'workload':10}{'goal':>10}" + "".join(f"{m + ' tok/s':>13}{'x':>7}" for m in modes)
    print(head + f"{'accepted/drafted':>18}{'same text':>11}")
    for w, row in table.items():
        cells = "".join(f"{row[m]['tok_s']:>13}{row[m]['vs_base']:>7}" for m in modes)
        acc = row[modes[-1]]["acceptance"]
        print(f"{w:10}{row['goal']:>10}{cells}{acc if acc is not None else '-':>18}"
              f"{'yes' if row['identical'] else 'NO':>11}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
