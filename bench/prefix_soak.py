"""Kept prefixes under a soak: memory stays within `--prefix-cache`, no request starves, and
the texts are those of an agent without the cache.

One agent serves the embedded model whole with a small prefix budget (so that entries are
evicted all the time). N requests (default 500), several at a time, each a chat of one of a
few shared system prompts and documents (so prompts share prefixes of different lengths) and
a question of its own. A poller reads the agent's kept bytes every 0.2 s. Then a sample of the
requests runs again, one at a time, on an agent started with `--prefix-cache 0`, and their
greedy texts must be the same.

Goal (issue 17): kept bytes never above the budget; every request answered; no slot starves
(the slowest request's time is reported against the median).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import result_file

from meshagent.launch import start_agent

SUBJECTS = ["tides", "bees", "volcanoes", "libraries", "ferries", "orchids", "comets", "mills"]


def shared_prefix(i: int) -> list[dict]:
    """The i-th shared opening: a system prompt, and a document of 20 to 160 words."""
    words = 20 + 20 * (i % 8)
    doc = " ".join(f"{SUBJECTS[(i + k) % len(SUBJECTS)]}-{k}" for k in range(words))
    return [
        {"role": "system", "content": f"Assistant {i}: answer in a few words."},
        {"role": "user", "content": f"Notes: {doc}"},
    ]


def requests(n: int, prefixes: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for j in range(n):
        msgs = shared_prefix(rng.randrange(prefixes))
        msgs += [
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": f"Question {j}: which {rng.choice(SUBJECTS)} came first?"},
        ]
        out.append(msgs)
    return out


def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    return {
        "text": data["choices"][0]["message"]["content"],
        "seconds": time.perf_counter() - start,
        "prompt_tokens": data["usage"]["prompt_tokens"],
        "cached_tokens": data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }


def model_status(url: str) -> dict:
    [m] = httpx.get(f"{url}/control/status", timeout=10).json()["models"]
    return m


def soak(args: argparse.Namespace, work: list[list[dict]]) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        agent = start_agent(
            Path(tmp), "--threads", str(args.threads), "--slots", str(args.slots),
            "--ctx-size", "1024", "--prefix-cache", args.budget, "--speculation", "off",
        )  # fmt: skip
        try:
            url = agent.url
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            budget = model_status(url)["prefix_cache"]["budget_bytes"]
            peak, samples, done = 0, 0, threading.Event()

            def poll() -> None:
                nonlocal peak, samples
                while not done.is_set():
                    peak = max(peak, model_status(url)["slots"]["prefix_bytes"])
                    samples += 1
                    time.sleep(0.2)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(
                    pool.map(lambda m: ask(url, model, m, args.max_tokens), work, timeout=3600)
                )
            wall = time.perf_counter() - start
            done.set()
            poller.join()
            slots = model_status(url)["slots"]
            return {
                "model": model,
                "budget_bytes": budget,
                "peak_kept_bytes": peak,
                "final_kept_bytes": slots["prefix_bytes"],
                "polls": samples,
                "wall_s": wall,
                "results": results,
                "hits": slots["prefix_hits"],
                "misses": slots["prefix_misses"],
                "entries_at_end": slots["prefix_entries"],
            }
        finally:
            agent.stop()


def plain(args: argparse.Namespace, work: list[list[dict]]) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="meshagent-bench-") as tmp:
        agent = start_agent(
            Path(tmp), "--threads", str(args.threads), "--slots", str(args.slots),
            "--ctx-size", "1024", "--prefix-cache", "0", "--speculation", "off",
        )  # fmt: skip
        try:
            model = httpx.get(f"{agent.url}/v1/models").json()["data"][0]["id"]
            return [ask(agent.url, model, m, args.max_tokens)["text"] for m in work]
        finally:
            agent.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--prefixes", type=int, default=24, help="shared openings to draw from")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--budget", default="12M", help="--prefix-cache of the agent")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--compare", type=int, default=40, help="requests rerun without the cache")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix_soak.json"))
    args = ap.parse_args()
    work = requests(args.requests, args.prefixes, args.seed)
    s = soak(args, work)
    rerun = list(range(0, args.requests, max(1, args.requests // args.compare)))[: args.compare]
    texts = plain(args, [work[i] for i in rerun])
    same = sum(s["results"][i]["text"] == t for i, t in zip(rerun, texts, strict=True))
    secs = sorted(r["seconds"] for r in s["results"])
    prompt = sum(r["prompt_tokens"] for r in s["results"])
    cached = sum(r["cached_tokens"] for r in s["results"])
    result = {
        "benchmark": "prefix_soak",
        "machine": result_file.machine(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "requests": len(s["results"]),
        "budget_bytes": s["budget_bytes"],
        "peak_kept_bytes": s["peak_kept_bytes"],
        "within_budget": s["peak_kept_bytes"] <= s["budget_bytes"],
        "polls": s["polls"],
        "hits": s["hits"],
        "misses": s["misses"],
        "entries_at_end": s["entries_at_end"],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "seconds": {
            "median": round(statistics.median(secs), 3),
            "p99": round(secs[int(0.99 * (len(secs) - 1))], 3),
            "max": round(secs[-1], 3),
        },
        "wall_s": round(s["wall_s"], 1),
        "compared": len(rerun),
        "identical": same,
    }
    mib = 1 << 20
    print(f"{'requests answered':34}{result['requests']} of {args.requests}")
    print(f"{'kept bytes: peak / budget':34}{s['peak_kept_bytes'] / mib:.2f} / "
          f"{s['budget_bytes'] / mib:.2f} MiB ({s['polls']} polls)")  # fmt: skip
    print(f"{'hits / misses':34}{s['hits']} / {s['misses']}")
    print(f"{'prompt tokens not prefilled':34}{cached} of {prompt}")
    sec = result["seconds"]
    print(f"{'request seconds median/p99/max':34}{sec['median']} / {sec['p99']} / {sec['max']}")
    print(f"{'same text with the cache off':34}{same} of {len(rerun)}")
    ok = result["within_budget"] and same == len(rerun) and result["requests"] == args.requests
    print(f"memory within --prefix-cache, every request answered, same texts: "
          f"{'yes' if ok else 'NO'}")  # fmt: skip
    result_file.write(args.out, result)


if __name__ == "__main__":
    main()
